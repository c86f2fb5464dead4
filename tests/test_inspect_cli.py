"""``cute-kv inspect``: printed numbers against torch views of a real collection, both query directions,
the request map against ``row_idx``, the PNG, and one-line usage errors (exit 2, nothing printed)."""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from cute_kv import KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheCollection, make_lookup_table
from cute_kv.__main__ import main

pytestmark = pytest.mark.compile

MHA_FP8 = ["--layers", "3", "--kv-heads", "2", "--head-dim", "64", "--page-size", "16", "--pages", "7",
           "--dtype", "fp8", "--granularity", "32", "--layer", "2"]
MLA = ["--preset", "deepseek-mla", "--layers", "2", "--head-dim", "96", "--page-size", "64", "--pages", "5",
       "--layer", "1"]


def collection(argv, lut=None, lengths=(0,)) -> PagedKVCacheCollection:
    """The collection ``argv`` describes, allocated on the CPU (the CLI itself uses the meta device)."""
    if "--preset" in argv:
        params = KVCacheParams(torch.bfloat16, 1, 96, page_size=64, total_num_layers=2, is_mla=True)
    else:
        params = KVCacheParams(torch.float8_e4m3fn, 2, 64, page_size=16, total_num_layers=3,
                               kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=32))
    n = int(argv[argv.index("--pages") + 1])
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, n, zero=False)
    lut = make_lookup_table([[]], sentinel=n) if lut is None else lut
    return PagedKVCacheCollection(blocks, torch.tensor(lengths, dtype=torch.uint32), lut, 0, max(lengths), scales)


def run(capsys, argv) -> str:
    assert main(["inspect", *argv]) == 0
    out, err = capsys.readouterr()
    assert not err
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def table(out: str) -> dict[str, tuple]:
    rows = re.findall(r"^  (\S.*?)\s+shape \[(.*?)\]\s+stride \[(.*?)\]\s+offset (\d+)$", out, re.M)
    return {name: (ints(shape), ints(stride), int(off)) for name, shape, stride, off in rows}


def described(t: torch.Tensor) -> tuple:
    return list(t.shape), list(t.stride()), t.storage_offset()


def layout_str(t: torch.Tensor) -> str:
    return f"({','.join(map(str, t.shape))}):({','.join(map(str, t.stride()))})"


def test_printed_numbers_match_torch(capsys):
    out = run(capsys, MHA_FP8)
    c = collection(MHA_FP8)
    k, v = c.get_key_cache(2), c.get_value_cache(2)
    expect = {
        "blocks": c.blocks, "key_blocks": c.key_blocks, "value_blocks": c.value_blocks, "scales": c.scales,
        "K cache l=2 .blocks": k.blocks, "V cache l=2 .blocks": v.blocks,
        "K .row_view()": k.row_view(), "V .row_view()": v.row_view(),
        "K cache l=2 .scales": k.scales, "V cache l=2 .scales": v.scales,
        "K .scales_row_view()": k.scales_row_view(), "V .scales_row_view()": v.scales_row_view(),
    }
    got = table(out)
    assert got == {name: described(t) for name, t in expect.items()}
    assert f"row pitch between pages {k.stride_rows} rows" in out and f"num_kv_rows {k.num_kv_rows()}" in out
    total = c.blocks.numel() * c.blocks.element_size() + c.scales.numel() * c.scales.element_size()
    per_page = total // c.num_pages
    assert f"per token  {per_page // c.page_size:,} " in out
    assert f"per page   {per_page:,} ({per_page // c.num_layers:,} per layer)" in out
    assert f"cache      {total:,} = " in out
    blocks_section = out.split("CuTe layouts of blocks, this cache")[1]
    assert f"cache                    {layout_str(c.blocks)}" in blocks_section
    assert f"K plane                  {layout_str(k.blocks)} + {k.blocks.storage_offset()}" in blocks_section
    assert f"V plane                  {layout_str(v.blocks)} + {v.blocks.storage_offset()}" in blocks_section
    assert f"row view                 {layout_str(k.row_view())}" in blocks_section
    assert f"TMA page view (P,D,H,N)  {layout_str(k.blocks.permute(1, 3, 2, 0))}" in blocks_section
    scales_section = out.split("CuTe layouts of scales, this cache")[1]
    assert f"V plane                  {layout_str(v.scales)} + {v.scales.storage_offset()}" in scales_section


@pytest.mark.parametrize("argv, tensor", [(MHA_FP8, "blocks"), (MHA_FP8, "scales"), (MLA, "blocks")])
def test_coord_offset_round_trip(capsys, rng, argv, tensor):
    c = collection(argv)
    full = c.scales if tensor == "scales" else c.blocks
    coords = [tuple(int(torch.randint(0, e, (1,), generator=rng)) for e in full.shape) for _ in range(4)]
    coords.append(tuple(e - 1 for e in full.shape))
    out = run(capsys, [*argv, "--tensor", tensor, *[a for crd in coords for a in ("--coord", ",".join(map(str, crd)))]])
    offsets = [int(x) for x in re.findall(r"<-> offset (\d+)", out)]
    strides = np.array(full.stride())
    assert offsets == [int(np.dot(crd, strides)) for crd in coords]
    for crd, block in zip(coords, out.split(f"\n{tensor}[")[1:]):
        n, kv, layer, p, h, d = crd
        plane = c._get_cache(kv, layer)
        lines = block.splitlines()
        assert ints(lines[1].split("=")[1]) == [n, p, h, d]
        assert ints(lines[2].split("=")[1].split("[")[0]) == [plane.get_tma_row(n * c.page_size + p), h, d]
        assert ints(lines[3].split("=")[1]) == [p, d, h, n]
    back = run(capsys, [*argv, "--tensor", tensor, *[a for x in offsets for a in ("--offset", str(x))]])
    assert [tuple(ints(m)) for m in re.findall(rf"^{tensor}\[(.*?)\] <->", back, re.M)] == coords


@pytest.mark.parametrize("length", [0, 1, 16, 37])
def test_request_map_matches_row_idx(capsys, length):
    argv = [*MHA_FP8, "--request-len", str(length), "--seed", "3"]
    out = run(capsys, argv)
    rows = re.findall(r"^  (\d+)-(\d+)\s+(\d+)\s+(\d+)\s+(\d+)-(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert len(rows) == -(-length // 16)
    pages = [int(r[3]) for r in rows]
    assert len(set(pages)) == len(pages) and all(0 <= q < 7 for q in pages)
    assert f"lookup_table[0] = {pages + [7]}" in out
    c = collection(argv, make_lookup_table([pages], sentinel=7), (length,))
    k, v = c.get_key_cache(2), c.get_value_cache(2)
    covered = []
    for j, (a, b, logical, _, r0, r1, k_off, v_off) in enumerate(ints(" ".join(r)) for r in rows):
        assert logical == j and a == 16 * j and b == min(16 * j + 15, length - 1)
        assert (r0, r1) == (k.row_idx(0, a), k.row_idx(0, b)) == (v.row_idx(0, a), v.row_idx(0, b))
        assert (k_off, v_off) == (k.block_paged_ptr(1, 0, a, 0), v.block_paged_ptr(1, 0, a, 0))
        covered += range(a, b + 1)
    assert covered == list(range(length))
    assert run(capsys, argv) == out  # --seed makes the shuffle reproducible


def test_png_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "map.png"
    out = run(capsys, [*MLA, "--request-len", "200", "--png", str(path)])
    assert f"page map written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_png_shows_what_is_particular_to_the_layout(capsys, tmp_path, monkeypatch):
    """One page's K/V x layer planes and its row pitch, the lookup row's sentinel columns, the page map, the rows."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    import cute_kv.inspect as inspect_module

    figures = []

    class Recorded(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    monkeypatch.setattr(inspect_module, "_figure_class", lambda: Recorded)
    run(capsys, [*MHA_FP8, "--request-len", "40", "--png", str(tmp_path / "map.png")])
    titles = " | ".join(ax.get_title() for ax in figures[0].axes)
    assert "one page: 2 x 3 layers x 16 rows (K then V)" in titles
    assert "row pitch between pages: KVD*L*P = 96 rows" in titles
    assert "the request's 3, then the sentinel N=7" in titles and "padded 24 columns" in titles
    texts = [t.get_text() for t in figures[0].axes[1].texts]
    assert texts.count("N") == 24 - 3  # one label per sentinel column
    assert [t.get_text() for t in figures[0].axes[0].texts] == ["K l=2: rows 32-47", "V l=2: rows 80-95"]


def test_mla_preset_scales_take_whole_granules(capsys):
    """MAX's default 128 does not divide the 576-dim MLA latent: the preset's scales default to 64 (G=9)."""
    from cute_kv.inspect import default_granularity

    assert [default_granularity(d) for d in (128, 576, 96, 64, 200)] == [128, 64, 32, 64, 8]
    out = run(capsys, ["--preset", "deepseek-mla", "--dtype", "fp8", "--scale-dtype", "f32", "--pages", "4"])
    assert "scales float32 per 64 dims (G=9)" in out.splitlines()[0]


def test_png_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = tmp_path / "map.png"
    with pytest.raises(SystemExit) as e:
        main(["inspect", *MLA, "--request-len", "20", "--png", str(path)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out and not path.exists()
    assert err.count("\n") == 1 and "matplotlib" in err


@pytest.mark.parametrize("argv, names", [
    (["--preset", "llama3-8b", "--coord", "64,0,0,0,0,0"], "--coord"),
    (["--preset", "llama3-8b", "--coord", "0,2,0,0,0,0"], "--coord"),
    (["--preset", "llama3-8b", "--coord", "1,2,x,0,0,0"], "--coord"),
    (["--preset", "llama3-8b", "--coord", "1,0,0"], "--coord"),
    (["--preset", "llama3-8b", "--offset", "-3"], "--offset"),
    (["--preset", "llama3-8b", "--pages", "2", "--offset", str(2 * 2**20)], "--offset"),
    (["--preset", "llama3-8b", "--dtype", "bf17"], "--dtype"),
    (["--preset", "llama3-8b", "--dtype", "fp8", "--granularity", "48"], "granularity"),
    (["--preset", "llama3-8b", "--scale-dtype", "f32"], "fp8"),
    (["--preset", "llama3-8b", "--tensor", "scales"], "--tensor"),
    (["--preset", "llama3-8b", "--layer", "32"], "--layer"),
    (["--preset", "llama3-8b", "--pages", "0"], "--pages"),
    (["--preset", "llama3-8b", "--page-size", "0"], "page_size"),
    (["--preset", "llama3-8b", "--request-len", "-1"], "--request-len"),
    (["--preset", "llama3-8b", "--pages", "4", "--request-len", "65"], "--request-len"),
    (["--preset", "llama3-8b", "--png", "x.png"], "--request-len"),
    (["--preset", "llama3-8b", "--mla"], "n_kv_heads"),
    (["--preset", "gpt5"], "--preset"),
    (["--layers", "2", "--head-dim", "64"], "--kv-heads"),
    (["--layers", "two"], "--layers"),
    (["--preset", "llama3-8b", "--layout", "vllm", "--layer", "1"], "--layer"),
    (["--preset", "llama3-8b", "--layout", "vllm", "--request-len", "4"], "--layout"),
    (["--preset", "deepseek-mla", "--layout", "separate"], "MLA"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, names):
    with pytest.raises(SystemExit) as e:
        main(["inspect", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out
    assert err.startswith("cute-kv inspect: error: ") and err.count("\n") == 1 and names in err, err


def test_module_entry_point():
    """``python -m cute_kv inspect`` end to end; ``import cute_kv`` itself does not import cutlass."""
    proc = subprocess.run([sys.executable, "-m", "cute_kv", "inspect", "--preset", "llama3-8b", "--pages", "8",
                           "--coord", "7,1,31,15,7,127"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The answer first, under the title; the cache's description after it.
    assert proc.stdout.splitlines()[2] == f"blocks[7, 1, 31, 15, 7, 127] <-> offset {8 * 2**20 - 1} (byte " \
                                          f"{2 * (8 * 2**20 - 1)})"
    assert "(?{i64},2,?{i64},16,8,128)" in proc.stdout
    light = subprocess.run([sys.executable, "-c", "import sys, cute_kv, cute_kv.__main__; "
                            "sys.exit('cutlass' in sys.modules)"], timeout=120)
    assert light.returncode == 0


def test_rope_aware_preset_prints_the_row(capsys):
    """The rope-aware FP8 MLA preset: 640-byte rows of 512 e4m3 content bytes and 64 bf16 rope values, one float32
    scale per token; the byte offsets printed are the collection's."""
    out = run(capsys, ["--preset", "deepseek-mla-fp8", "--pages", "4", "--page-size", "64", "--layers", "3"])
    assert "rope-aware [512 fp8 | 64 bf16]" in out.splitlines()[0] and "(G=1)" in out.splitlines()[0]
    assert "bytes [0, 512)  content: 512 e4m3 values" in out
    assert "bytes [512, 640)  rope: 64 bf16 values" in out
    assert "latent_dim 576 = 512 + 64" in out
    rows = 3 * 3 * 64 + 64  # (N-1)*KVD*L*P + P
    assert f"content (fp8) ({rows},512):(640,1); rope (bf16, from element 256) ({rows},64):(320,1)" in out
    assert "per token  1,932 (644 per layer)" in out  # 640 bytes + a 4-byte scale per layer


@pytest.mark.parametrize("argv, names", [
    (["--preset", "deepseek-mla", "--rope-dim", "64"], "fp8"),
    (["--preset", "deepseek-mla-fp8", "--head-dim", "600"], "multiple of 64"),
    (["--preset", "deepseek-mla-fp8", "--scale-dtype", "e8m0"], "float32 scales"),
    (["--preset", "llama3-8b", "--dtype", "fp8", "--rope-dim", "16"], "MLA caches only"),
])
def test_bad_rope_aware_arguments_exit_2_with_one_line(capsys, argv, names):
    test_bad_arguments_exit_2_with_one_line(capsys, argv, names)


@pytest.mark.parametrize("layout", ["vllm", "flashinfer-hnd", "separate"])
def test_engine_layouts_print_their_strides(capsys, layout):
    """``--layout``: one layer of another engine's K/V tensors, printed as ``from_kv`` views them."""
    from cute_kv.kv_layout import engine_kv

    out = run(capsys, ["--kv-heads", "2", "--head-dim", "64", "--layers", "3", "--pages", "7", "--layout", layout])
    k, v = engine_kv(layout, 7, 16, 2, 64, torch.bfloat16)
    c = PagedKVCacheCollection.from_kv(k, v, torch.zeros(1, dtype=torch.int32), make_lookup_table([[]], sentinel=7),
                                       0, 0)
    kc, vc = c.get_key_cache(0), c.get_value_cache(0)
    expect = {"key_blocks": c.key_blocks, "value_blocks": c.value_blocks,
              "K cache l=0 .blocks": kc.blocks, "V cache l=0 .blocks": vc.blocks,
              "K .row_view()": kc.row_view(), "V .row_view()": vc.row_view()}
    if c.blocks is not None:
        expect["blocks"] = c.blocks
    assert table(out) == {name: described(t) for name, t in expect.items()}
    assert f"row pitch between pages {kc.stride_rows} rows" in out and "CuTe layouts" not in out
    one_layer = 2 * k.numel() * k.element_size()  # the sizes are of the layer shown, not of MAX's 3
    assert f"per page   {one_layer // 7:,} " in out and f"cache      {one_layer:,} = " in out and "1 of 3 layers" in out
