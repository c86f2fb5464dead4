"""``cute-kv explain OP``: the decision ``cute_kv.explain`` gives for the same arguments, per arch, and one-line usage
errors (exit 2, nothing printed)."""

import re
import subprocess
import sys

import pytest
import torch

import cute_kv
from cute_kv.__main__ import main
from cute_kv.kernels.archs import ARCHS
from cute_kv.reference.batch import random_paged_batch

GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "128", "--page-size", "16", "--q-heads", "8",
            "--cached", "37", "5", "--new", "1", "3"]
CACHED, NEW = [37, 5], [1, 3]


def run(capsys, argv) -> str:
    assert main(["explain", *argv]) == 0
    out, err = capsys.readouterr()
    assert not err
    return out


def decisions(out: str) -> dict:
    """``{arch: (path, kernel or None, key text or None)}`` as printed."""
    found = {}
    for arch, path, kernel, key in re.findall(r"^\S+ on (sm_\w+): (kernel|reference) ?(\S*)\n  why: .*\n"
                                              r"(?:  key: (.*)\n)?", out, re.M):
        found[arch] = (path, kernel or None, key or None)
    return found


def api(op, *args, **kwargs) -> dict:
    paths = {arch: cute_kv.explain(op, *args, arch=arch, **kwargs) for arch in ARCHS}
    return {arch: (p.path, p.kernel, None if p.key is None else str(p.key)) for arch, p in paths.items()}


@pytest.mark.parametrize("dtype,extra", [(torch.bfloat16, []), (torch.float16, ["--window", "64", "--return-lse"])])
def test_paged_attention_decisions_equal_the_api(capsys, rng, dtype, extra):
    out = run(capsys, ["paged_attention", *GEOMETRY, "--dtype", "f16" if dtype == torch.float16 else "bf16", *extra])
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=128, page_size=16, generator=rng, dtype=dtype)
    q = torch.empty(sum(NEW), 8, 128, dtype=dtype)
    window = 64 if extra else None
    want = api("paged_attention", q, pb.input_row_offsets, pb.collection, 0, window=window, return_lse=bool(extra))
    assert decisions(out) == want and all(path == "kernel" for path, _, _ in want.values())
    assert "step: 2 requests, cached [37, 5], new [1, 3] (4 rows; max_seq_length 3, max_cache_length 38); " \
           f"q [4, 8, 128] {str(dtype)[6:]}" in out


def test_store_gather_and_a_reference_reason(capsys, rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=128, page_size=16, generator=rng)
    k = torch.empty(sum(NEW), 2, 128, dtype=torch.bfloat16)
    assert decisions(run(capsys, ["store_kv", *GEOMETRY])) == api("store_kv", k, k, pb.input_row_offsets,
                                                                  pb.collection, 0)
    assert decisions(run(capsys, ["gather_kv", *GEOMETRY, "--kv", "v"])) == api("gather_kv", pb.collection, 0, kv="v")
    out = run(capsys, ["sparse_mla_attention", "--preset", "deepseek-mla", "--cached", "300", "--arch", "sm_90a"])
    assert decisions(out) == {"sm_90a": ("reference", None, None)}
    assert "why: no sparse MLA kernel on sm_90a yet" in out


@pytest.mark.parametrize("op", ["store_kv", "paged_attention"])
def test_tensor_scales(capsys, rng, op):
    """``--tensor-scales``: an fp8 cache with per-tensor ``k_scale`` / ``v_scale`` takes the kernels that scale per
    tensor, as the API says."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=128, page_size=16, generator=rng,
                            dtype=torch.float8_e4m3fn)
    x = torch.empty(sum(NEW), 2 if op == "store_kv" else 8, 128, dtype=torch.bfloat16)
    args = (x, x) if op == "store_kv" else (x,)
    want = api(op, *args, pb.input_row_offsets, pb.collection, 0, k_scale=1.0, v_scale=1.0)
    assert decisions(run(capsys, [op, *GEOMETRY, "--dtype", "fp8", "--tensor-scales"])) == want
    assert all(path == "kernel" and key.endswith("'compact', True)") for path, _, key in want.values())


def test_fused_qkv_with_rope(capsys, rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=128, page_size=16, generator=rng)
    hidden, weight = torch.empty(4, 512, dtype=torch.bfloat16), torch.empty(8 * 128 + 512, 512, dtype=torch.bfloat16)
    rope = cute_kv.RopeConfig.from_theta(128, 64)
    out = run(capsys, ["fused_qkv_matmul_kv_cache", *GEOMETRY, "--hidden", "512", "--rope", "128"])
    assert decisions(out) == api("fused_qkv_matmul_kv_cache", hidden, pb.input_row_offsets, weight, pb.collection, 0,
                                 rope=rope)


@pytest.mark.parametrize("argv,names", [
    (["paged_attention", *GEOMETRY[:-6], "--q-heads", "3"], "q heads (3) must be a positive multiple"),
    (["paged_attention", "--preset", "llama3-8b", "--cached", "5", "6", "--new", "1", "2", "3"], "--new must give"),
    (["paged_attention", "--preset", "llama3-8b", "--pages", "1", "--cached", "100"], "--pages 1: the step needs 7"),
    (["paged_attention", "--kv-heads", "2"], "--head-dim is required"),
    (["sparse_mla_attention", "--mla", "--head-dim", "576", "--q-heads", "16"], "needs --mla-v-dim"),
    (["gather_kv", *GEOMETRY, "--dtype", "fp8", "--tensor-scales"], "--tensor-scales is for store_kv and"),
    (["store_kv", *GEOMETRY, "--tensor-scales"], "per-tensor scales of an fp8 e4m3 cache"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, names):
    with pytest.raises(SystemExit) as e:
        main(["explain", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out
    assert err.startswith("cute-kv explain: error: ") and err.count("\n") == 1 and names in err, err


def test_module_entry_point():
    """``python -m cute_kv explain`` end to end, at a real model's size (nothing is allocated)."""
    proc = subprocess.run([sys.executable, "-m", "cute_kv", "explain", "paged_attention", "--preset", "llama3-8b",
                           "--cached", "131072", "--arch", "sm_100a"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (path, kernel, key), = decisions(proc.stdout).values()
    assert (path, kernel) == ("kernel", "PagedAttentionSm100") and key.startswith("('paged_attention_sm100', "
                                                                                  "'bfloat16', 32, 8, 128, 16,")
    assert "llama3-8b: bf16 MHA (KVD=2) | 32 layers x 8 KV heads x head_dim 128 | page_size 16 | 8193 pages" \
        in proc.stdout
