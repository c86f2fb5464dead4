"""README's API tour is ``examples/tour.py`` word for word, and it runs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "examples", "tour.py")


def test_readme_shows_the_tour_file():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(TOUR) as f:
        tour = f.read()
    section = readme[readme.index("## API tour"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == tour


def test_tour_runs():
    out = subprocess.run([sys.executable, TOUR], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "KernelPath(op='paged_attention', path='kernel'" in out.stdout


def test_readme_peer_metadata_recipe():
    """README's "Coming from FlashInfer, vLLM or FA4" recipe, run on a step's metadata in each peer's form (their
    lengths count the step's tokens): the collections it builds attend exactly as the step's own."""
    import torch

    import cute_kv
    from cute_kv.reference.batch import random_paged_batch

    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("### Coming from FlashInfer"):]
    recipe = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    vllm_part = recipe[:recipe.index("# FlashInfer")]
    cached, new, p = [37, 0, 5, 16], [1, 3, 0, 16], 16
    pb = random_paged_batch(cached, new, num_heads=2, head_size=16, page_size=p, generator=torch.Generator(),
                            dtype=torch.float32)
    c = pb.collection
    ends = [a + b for a, b in zip(cached, new)]
    used = [-(-e // p) for e in ends]

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    peer = {
        "torch": torch, "cute_kv": cute_kv, "P": p, "N": c.num_pages, "ro": pb.input_row_offsets.to(torch.int32),
        "seq_lens": i32(ends), "block_table": i32([pages + [0] * (max(used) - len(pages)) for pages in pb.pages]),
        "kv_indptr": i32([0, *torch.tensor(used).cumsum(0).tolist()]),
        "kv_indices": i32([page for b, n in enumerate(used) for page in pb.pages[b][:n]] + [c.num_pages] * 3),
        "kv_last_page_len": i32([e - (n - 1) * p for e, n in zip(ends, used)]),
    }
    q = torch.randn(sum(new), 4, 16)
    want = cute_kv.paged_attention(q, pb.input_row_offsets, c, 0)
    for code in (vllm_part, recipe):  # vLLM / FA4, then FlashInfer
        names = dict(peer)
        exec(code, names)
        assert names["cache_lengths"].tolist() == cached
        coll = c.with_metadata(names["cache_lengths"], names["lookup_table"], max(new), max(ends))
        assert torch.equal(cute_kv.paged_attention(q, peer["ro"], coll, 0), want)


def test_readme_peer_layouts_are_views_where_it_says():
    """The layout table's mappings: FlashInfer's one-tensor NHD cache and K/V unbound from it are views of the
    blocks (writes through the collection land in the peer's tensor); vLLM's K/V-outermost cache is a copy."""
    import torch

    from cute_kv import PagedKVCacheCollection, make_lookup_table

    n, p, h, d = 4, 16, 2, 8
    kv = torch.randn(n, 2, p, h, d)
    lut = make_lookup_table([[2, 0]], sentinel=n)
    coll = PagedKVCacheCollection(kv.unsqueeze(2), torch.tensor([20], dtype=torch.int32), lut, 0, 20)
    assert coll.blocks.data_ptr() == kv.data_ptr()
    k_cache, v_cache = kv.unbind(1)
    assert torch.equal(coll.get_value_cache(0).gather(0, 0, 20), torch.cat([v_cache[2], v_cache[0, :4]]))
    vllm = torch.randn(2, n, p, h, d)
    blocks = vllm.transpose(0, 1).contiguous().unsqueeze(2)
    assert torch.equal(blocks[:, 0, 0], vllm[0]) and torch.equal(blocks[:, 1, 0], vllm[1])
