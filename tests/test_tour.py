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


def test_readme_peer_layouts_are_views():
    """The layout table's ``from_kv`` recipes: each peer's cache is taken in place (a value written through the
    collection lands in the peer's tensor)."""
    import torch

    from cute_kv import PagedKVCacheCollection, make_lookup_table

    n, p, h, d = 4, 16, 2, 8
    lut = make_lookup_table([[2, 0]], sentinel=n)
    nhd, hnd = torch.zeros(n, 2, p, h, d), torch.zeros(n, 2, h, p, d)
    vllm, k_cache, v_cache = torch.zeros(2, n, p, h, d), torch.zeros(n, p, h, d), torch.zeros(n, p, h, d)
    recipes = {"vllm": (vllm[0], vllm[1]), "nhd": (nhd[:, 0], nhd[:, 1]),
               "hnd": (hnd[:, 0].permute(0, 2, 1, 3), hnd[:, 1].permute(0, 2, 1, 3)), "fa4": (k_cache, v_cache)}
    for name, (k, v) in recipes.items():
        coll = PagedKVCacheCollection.from_kv(k, v, torch.tensor([20], dtype=torch.int32), lut, 0, 20)
        assert coll.is_compact == (name == "nhd"), name
        coll.get_value_cache(0).store(0, 1, 17, 0, torch.ones(d))  # token 17: page 0, slot 1, head 1
        assert torch.equal(v[0, 1, 1], torch.ones(d)) and int(v.count_nonzero()) == d and not k.any(), name
