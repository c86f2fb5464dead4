"""``cute-kv inspect``: a paged cache's shapes, strides, sizes and CuTe layouts; coordinate <-> offset; a
sample request's tokens mapped to pages and rows (optionally drawn to a PNG).

Sizes come from ``KVCacheParams``; shapes, strides and view offsets from a ``PagedKVCacheCollection`` on the
meta device (nothing is allocated, so real model sizes are fine); coordinates, offsets and rows are
evaluated through the CuTe layouts of ``cute_kv.layouts`` (imported only here: ``import cute_kv`` stays light).
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import torch

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.dtypes import dtype_name, parse_dtype
from cute_kv.kv_layout import ENGINE_LAYOUTS, engine_kv
from cute_kv.metadata import make_lookup_table
from cute_kv.params import KVCacheParams, KVCacheQuantizationConfig

PRESETS = {  # the cache's geometry; q_heads and mla_v_dim are the model's, for `cute-kv explain`
    "llama3-8b": dict(layers=32, kv_heads=8, head_dim=128, dtype="bf16", mla=False, q_heads=32),
    "deepseek-mla": dict(layers=61, kv_heads=1, head_dim=576, dtype="bf16", mla=True, q_heads=128, mla_v_dim=512),
    # MAX's rope-aware FP8 rows: 512 e4m3 content bytes | 64 bf16 rope values, one float32 scale per token.
    "deepseek-mla-fp8": dict(layers=61, kv_heads=1, head_dim=640, dtype="fp8", mla=True, rope_dim=64, q_heads=128,
                             mla_v_dim=512),
}
SCALE_DTYPES = {"f32": torch.float32, "e8m0": torch.float8_e8m0fnu}
# Requests longer than this many pages print their head and tail only.
MAX_PAGE_LINES = 32


def add_parser(commands) -> None:
    p = commands.add_parser(
        "inspect", help="shapes, strides, sizes and CuTe layouts of a paged KV cache",
        description="Describe a paged KV cache blocks[N, KVD, L, P, H, D] (and scales[N, KVD, L, P, H, G]).")
    g = p.add_argument_group("geometry (a preset fills what is not given)")
    add_geometry_arguments(g)
    g.add_argument("--pages", type=int, default=64, help="N, physical pages (default 64)")
    g.add_argument("--layout", choices=("max", *ENGINE_LAYOUTS), default="max",
                   help="MAX's blocks (default), or one layer of another engine's K/V tensors (from_kv)")
    q = p.add_argument_group("queries")
    q.add_argument("--layer", type=int, default=0, help="layer of the views and the request map (default 0)")
    q.add_argument("--tensor", choices=("blocks", "scales"), default="blocks", help="tensor of --coord/--offset")
    q.add_argument("--coord", action="append", default=[], metavar="n,k,l,p,h,d", help="element -> offset")
    q.add_argument("--offset", action="append", default=[], type=int, metavar="X", help="offset -> element")
    q.add_argument("--request-len", type=int, metavar="T", help="map a T-token request on shuffled pages")
    q.add_argument("--seed", type=int, default=0, help="page shuffle of --request-len (default 0)")
    q.add_argument("--png", metavar="FILE", help="draw the request's page map (needs matplotlib)")
    p.set_defaults(func=run, error=p.error)


def add_geometry_arguments(g) -> None:
    """The cache geometry options (``cache_params`` reads them); ``--pages`` is each command's own."""
    g.add_argument("--preset", choices=sorted(PRESETS))
    g.add_argument("--layers", type=int, help="L")
    g.add_argument("--kv-heads", type=int, help="H, KV heads (1 with --mla)")
    g.add_argument("--head-dim", type=int, help="D")
    g.add_argument("--page-size", type=int, default=16, help="P, tokens per page (default 16)")
    g.add_argument("--dtype", help="bf16 (default), f16, f32 or fp8")
    g.add_argument("--mla", action="store_true", default=None, help="K only (KVD=1)")
    g.add_argument("--scale-dtype", choices=sorted(SCALE_DTYPES), help="fp8 scales (default f32 with --granularity)")
    g.add_argument("--granularity", type=int,
                   help="head dims per scale (default with --scale-dtype: 128, or the largest power of two "
                        "dividing the head dim, 64 for MLA's 576)")
    g.add_argument("--rope-dim", type=int,
                   help="rope-aware FP8 MLA rows: bf16 rope values after head_dim - 2*rope_dim content bytes "
                        "(--head-dim counts bytes; one float32 scale per token)")


def run(args: argparse.Namespace) -> int:
    try:
        name, params = cache_params(args)
        if not isinstance(args.pages, int) or args.pages <= 0:
            raise ValueError(f"--pages must be a positive int, got {args.pages}")
        coll = _collection(params, args.pages, args.layout)
        if not 0 <= args.layer < coll.num_layers:
            raise ValueError(f"--layer must be in [0, {coll.num_layers}), got {args.layer}")
        if args.layout != "max" and (args.coord or args.offset or args.request_len is not None):
            raise ValueError("--coord, --offset and --request-len address MAX's blocks; drop --layout")
        tensor = coll.scales if args.tensor == "scales" else coll.blocks
        if tensor is None and args.tensor == "scales":
            raise ValueError("--tensor scales needs a quantized cache (--dtype fp8 with --scale-dtype/--granularity)")
        last = "g" if args.tensor == "scales" else "d"
        coords = [_parse_coord(text, tuple(tensor.shape), last) for text in args.coord]
        for x in args.offset:
            if not 0 <= x < tensor.numel():
                raise ValueError(f"--offset {x} is outside {args.tensor} ({tensor.numel()} elements)")
        pages = _request_pages(args, coll)
        if args.png and pages is None:
            raise ValueError("--png draws a request's page map: give --request-len")
        plot = _figure_class() if args.png else None
    except ValueError as e:
        args.error(str(e))

    from cute_kv import layouts  # imports cutlass

    heading = title(name, params, coll) + ("" if args.layout == "max" else f" | {args.layout} layout, one layer")
    print(heading)
    # The queries' answers first (MAX's blocks only), then the cache they are answered in.
    stride_rows = coll.get_key_cache(0).stride_rows
    if coords:
        for c, off in zip(coords, layouts.offsets("cache", tuple(tensor.shape), coords)):
            _print_element(layouts, args.tensor, tensor, stride_rows, c, int(off))
    if args.offset:
        for c, off in zip(layouts.coordinates("cache", tuple(tensor.shape), args.offset), args.offset):
            _print_element(layouts, args.tensor, tensor, stride_rows, tuple(int(x) for x in c), off)
    _print_tensors(coll, args.layer)
    if coll.rope_dim is not None:
        _print_rope_aware_row(layouts, coll)
    _print_sizes(params, coll)
    if coll.is_compact:  # the CuTe views of MAX's blocks
        _print_layouts(layouts, coll, args.layer)
    if pages is not None:
        rows = _print_request(layouts, coll, args, pages)
        if args.png:
            _draw_page_map(plot, args.png, heading, coll, pages, rows, args.layer)
            print(f"\npage map written to {args.png}")
    return 0


# -- arguments --------------------------------------------------------------------------------------


def cache_params(args, layers: Optional[int] = None) -> tuple[str, KVCacheParams]:
    """``(preset name or "custom", KVCacheParams)`` from ``add_geometry_arguments``' options; ``layers`` is the
    default of ``--layers`` where no preset gives it (else it is required)."""
    preset = PRESETS.get(args.preset, {})
    mla = bool(args.mla or preset.get("mla"))

    def pick(flag, key, default=None):
        value = getattr(args, key)
        value = preset.get(key, default) if value is None else value
        if value is None:
            raise ValueError(f"--{flag} is required (or pick a --preset: {', '.join(sorted(PRESETS))})")
        return value

    layers = pick("layers", "layers", layers)
    kv_heads = pick("kv-heads", "kv_heads", 1 if mla else None)
    head_dim = pick("head-dim", "head_dim")
    try:
        dtype = parse_dtype(pick("dtype", "dtype", "bf16"))
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None
    quant = {}  # either flag asks for scales; the other keeps MAX's default
    rope_dim = args.rope_dim if args.rope_dim is not None else preset.get("rope_dim")
    if rope_dim is not None:  # one scale per token: the whole row is the granule
        quant.update(rope_dim=rope_dim, quantization_granularity=head_dim)
    if args.scale_dtype:
        quant["scale_dtype"] = SCALE_DTYPES[args.scale_dtype]
        quant.setdefault("quantization_granularity", default_granularity(head_dim))
    if args.granularity is not None:
        quant["quantization_granularity"] = args.granularity
    params = KVCacheParams(dtype, kv_heads, head_dim, page_size=args.page_size, total_num_layers=layers,
                           is_mla=mla, kvcache_quant_config=KVCacheQuantizationConfig(**quant) if quant else None)
    return args.preset or "custom", params


def default_granularity(head_dim: int) -> int:
    """MAX's 128 where it divides the head dim, else the largest power of two below it that does (576, the MLA
    latent: 64), so every granule is whole."""
    return next((g for g in (128, 64, 32, 16, 8) if head_dim % g == 0), 128)


def _collection(params: KVCacheParams, num_pages: int, layout: str = "max") -> PagedKVCacheCollection:
    """The cache on the meta device: shapes, strides and offsets of any size, nothing allocated or read; another
    engine's ``layout`` holds one layer, allocated on the CPU (``from_kv`` tells K and V apart by their memory)."""
    granularity = params.kvcache_quant_config and params.kvcache_quant_config.quantization_granularity
    if layout == "max":
        blocks, scales = PagedKVCacheCollection.allocate_blocks(params, num_pages, device="meta")
        return PagedKVCacheCollection(
            blocks, torch.empty(1, dtype=torch.uint32, device="meta"),
            torch.empty(1, 1, dtype=torch.uint32, device="meta"), 0, 0, scales,
            quantization_granularity=granularity, rope_dim=params.rope_dim, validate=False)
    if params.is_mla:
        raise ValueError(f"--layout {layout}: another engine's layout holds K and V; an MLA cache is K only")
    kvd, _, p, h, d = params.shape_per_block
    k, v = engine_kv(layout, num_pages, p, h, d, params.dtype)
    scales = None
    if params.quantized_kv_cache:
        scales = torch.ones([num_pages, kvd, 1, *params.shape_per_scale_block[2:]],
                            dtype=params.kvcache_quant_config.scale_dtype)
    return PagedKVCacheCollection.from_kv(k, v, torch.zeros(1, dtype=torch.uint32),
                                          torch.zeros(1, 1, dtype=torch.uint32), 0, 0, scales,
                                          quantization_granularity=granularity, validate=False)


def _parse_coord(text: str, shape: tuple[int, ...], last: str) -> tuple[int, ...]:
    names = ("n", "k", "l", "p", "h", last)
    try:
        coord = tuple(int(x) for x in text.split(","))
    except ValueError:
        coord = ()
    if len(coord) != 6:
        raise ValueError(f"--coord {text!r} must be 6 comma-separated ints n,k,l,p,h,{last}")
    for name, c, extent in zip(names, coord, shape):
        if not 0 <= c < extent:
            raise ValueError(f"--coord {text}: {name}={c} is outside [0, {extent})")
    return coord


def _request_pages(args, coll: PagedKVCacheCollection):
    """Physical pages of the sample request: the first ``ceil(T/P)`` of a seeded shuffle of all pages."""
    if args.request_len is None:
        return None
    if args.request_len < 0:
        raise ValueError(f"--request-len must be >= 0, got {args.request_len}")
    need = -(-args.request_len // coll.page_size)
    if need > coll.num_pages:
        raise ValueError(f"--request-len {args.request_len} needs {need} pages of {coll.page_size}; "
                         f"--pages is {coll.num_pages}")
    perm = torch.randperm(coll.num_pages, generator=torch.Generator().manual_seed(args.seed))
    return perm[:need].tolist()


def _figure_class():
    try:
        from matplotlib.figure import Figure  # Agg canvas, no pyplot global state
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'cute-kv[plot]'") from None
    return Figure


# -- report -----------------------------------------------------------------------------------------


def title(name: str, params: KVCacheParams, coll: PagedKVCacheCollection) -> str:
    kind = "MLA (KVD=1)" if params.is_mla else "MHA (KVD=2)"
    if params.rope_dim is not None:
        kind += f" rope-aware [{params.padded_depth} fp8 | {params.rope_dim} bf16]"
    quant = ""
    if params.quantized_kv_cache:
        q = params.kvcache_quant_config
        quant = (f" | scales {dtype_name(q.scale_dtype)} per {q.quantization_granularity} dims "
                 f"(G={params.head_dim_granularity})")
    return (f"{name}: {params.dtype_shorthand} {kind} | {params.num_layers} layers x {params.n_kv_heads} KV heads "
            f"x head_dim {params.head_dim} | page_size {params.page_size} | {coll.num_pages} pages{quant}")


def _print_tensors(coll: PagedKVCacheCollection, layer: int) -> None:
    # blocks (None when K and V are separate tensors), then the K / V planes every op reads the cache through
    rows = [] if coll.blocks is None else [("blocks", coll.blocks)]
    rows += [("key_blocks", coll.key_blocks)] + ([] if coll.is_mla else [("value_blocks", coll.value_blocks)])
    for what, full in (("blocks", coll.key_blocks), ("scales", coll.scales)):
        if full is None:
            continue
        if what == "scales":
            rows.append((what, full))
        for kv in range(coll.kv_dim):
            plane = coll._get_cache(kv, layer)
            which = "KV"[kv]
            if what == "blocks":
                rows += [(f"{which} cache l={layer} .blocks", plane.blocks), (f"{which} .row_view()", plane.row_view())]
            else:
                rows += [(f"{which} cache l={layer} .scales", plane.scales),
                         (f"{which} .scales_row_view()", plane.scales_row_view())]
    cells = [(n, str(list(t.shape)), str(list(t.stride())), str(t.storage_offset())) for n, t in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    print("\ntensor (elements)")
    for n, shape, stride, off in cells:
        print(f"  {n:<{widths[0]}}  shape {shape:<{widths[1]}}  stride {stride:<{widths[2]}}  offset {off}")
    plane = coll.get_key_cache(layer)
    pitch = "KVD*L*P, " if coll.is_compact else ""
    print(f"  row pitch between pages {plane.stride_rows} rows ({pitch}page stride / token stride); "
          f"num_kv_rows {plane.num_kv_rows()}")


def _print_rope_aware_row(layouts, coll: PagedKVCacheCollection) -> None:
    """A row's bytes (content | rope), its scale, its logical width, and the CuTe views kernels read it through."""
    pd, r, row = coll.padded_depth, coll.rope_dim, coll.head_size
    print(f"\nrope-aware row ({row} bytes per token and layer; scale index = row index)")
    print(f"  bytes [0, {pd})  content: {pd} e4m3 values, times the token's scale")
    print(f"  bytes [{pd}, {row})  rope: {r} bf16 values (little endian)")
    print(f"  scale: float32, one per token ({coll.scales.element_size()} bytes)")
    print(f"  logical row (q and k width): latent_dim {coll.latent_dim} = {pd} + {r}")
    views = layouts.rope_aware.describe(coll.num_pages, coll.num_layers, coll.page_size, pd, r)
    print(f"  CuTe views from the plane's base: content (fp8) {views['content']}; rope (bf16, from element "
          f"{layouts.rope_aware.rope_offset(pd)}) {views['rope']}; scales (f32) {views['scales']}")


def _print_sizes(params: KVCacheParams, coll: PagedKVCacheCollection) -> None:
    """Bytes of the cache shown: MAX's blocks of every layer, or the one layer another engine's layout holds."""
    nl, held = params.num_layers, coll.num_layers
    per_layer_token, per_layer_page = params.bytes_per_token // nl, params.bytes_per_block // nl
    token, page = per_layer_token * held, per_layer_page * held
    total = page * coll.num_pages
    print(f"\nbytes (K{'' if params.is_mla else ' and V'}{', scales' if params.quantized_kv_cache else ''}, "
          f"{'all ' if held == nl else f'{held} of '}{nl} layers)")
    print(f"  per token  {token:,} ({per_layer_token:,} per layer)")
    print(f"  per page   {page:,} ({per_layer_page:,} per layer)")
    print(f"  cache      {total:,} = {_human(total)} ({_human(total // held)} per layer)")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def _print_layouts(layouts, coll: PagedKVCacheCollection, layer: int) -> None:
    for what, full in (("blocks", coll.blocks), ("scales", coll.scales)):
        if full is None:
            continue
        shape = tuple(full.shape)
        planes = [layouts.layout_strings(shape, kv, layer) for kv in range(coll.kv_dim)]
        kernel = layouts.layout_strings(shape, 0, layer, kernel=True)
        print(f"\nCuTe layouts of {what}, this cache (layer {layer})")
        _print_layout_rows(planes[0], [(f"{'KV'[kv]} plane", s) for kv, s in enumerate(planes)])
        print(f"CuTe layouts of {what} as a kernel traces them (N, L, kv, layer runtime; KVD, P, H, D static)")
        _print_layout_rows(kernel, [("plane", kernel)])


def _print_layout_rows(strings: dict, planes: list) -> None:
    """Plane-independent views from ``strings``; one line per plane with its base offset."""
    rows = [("cache", strings["cache"])]
    rows += [(label, f"{s['plane']} + {s['plane_offset']}") for label, s in planes]
    rows += [("row view", strings["row_view"]), ("TMA page view (P,D,H,N)", strings["tma_page_view"]),
             ("(page, slot) -> row", strings["token_row"])]
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"  {label:<{width}}  {text}")


def _print_element(layouts, what: str, tensor: torch.Tensor, stride_rows: int, coord: tuple, offset: int) -> None:
    shape = tuple(tensor.shape)
    n, kv, layer, p, h, d = coord
    last = "g" if what == "scales" else "d"
    plane = layouts.coordinates("plane", shape, [offset], kv, layer)[0]
    row = layouts.coordinates("row_view", shape, [offset], kv, layer)[0]
    tma = layouts.coordinates("tma_page_view", shape, [offset], kv, layer)[0]
    print(f"\n{what}[{n}, {kv}, {layer}, {p}, {h}, {d}] <-> offset {offset} (byte {offset * tensor.element_size()})")
    print(f"  {'KV'[kv]} cache layer {layer}: (n, p, h, {last}) = {_tuple(plane)}")
    print(f"  row view: (row, h, {last}) = {_tuple(row)}  [row = page {n} * {stride_rows} + slot {p}]")
    print(f"  TMA page view: (p, {last}, h, n) = {_tuple(tma)}")


def _tuple(a) -> str:
    return "(" + ", ".join(str(int(x)) for x in a) + ")"


def _print_request(layouts, coll: PagedKVCacheCollection, args, pages: list[int]):
    """Print the request's pages and rows; return each token's physical row (int64 numpy)."""
    import numpy as np

    t_len, p, layer = args.request_len, coll.page_size, args.layer
    lut = make_lookup_table([pages], sentinel=coll.num_pages)
    shown = lut[0, : min(len(pages) + 1, 16)].tolist()
    print(f"\nrequest: {t_len} tokens on {len(pages)} pages (seed {args.seed}); layer {layer}")
    print(f"  lookup_table[0] = {shown}{' ...' if lut.shape[1] > len(shown) else ''} "
          f"({lut.shape[1]} columns, sentinel {coll.num_pages})")
    if not t_len:
        return np.zeros(0, np.int64)
    shape = tuple(coll.blocks.shape)
    tok = np.arange(t_len)
    page_of = lut[0].to(torch.int64).numpy()[tok // p]
    rows = layouts.offsets("token_row", shape, np.stack([page_of, tok % p], 1))
    firsts = np.arange(0, t_len, p)  # row of each page's first token, head 0, dim 0
    zeros = np.zeros_like(firsts)
    starts = {kv: layouts.offsets("row_view", shape, np.stack([rows[firsts], zeros, zeros], 1), kv, layer)
              for kv in range(coll.kv_dim)}
    print("  tokens         page  physical  rows (row_idx)          " +
          "  ".join(f"{'KV'[kv]} offset" for kv in range(coll.kv_dim)))
    lines = range(len(pages))
    if len(pages) > MAX_PAGE_LINES:
        lines = [*range(MAX_PAGE_LINES - 8), None, *range(len(pages) - 8, len(pages))]
    for j in lines:
        if j is None:
            print("  ...")
            continue
        a, b = j * p, min((j + 1) * p, t_len) - 1
        offs = "  ".join(f"{int(starts[kv][j]):>8}" for kv in range(coll.kv_dim))
        print(f"  {f'{a}-{b}':<14} {j:>4}  {pages[j]:>8}  {f'{int(rows[a])}-{int(rows[b])}':<22}  {offs}")
    return rows


def _draw_page_map(figure_cls, path: str, title: str, coll: PagedKVCacheCollection, pages, rows,
                   layer: int) -> None:
    """What is particular to this layout, in four panels: one page's rows (K/V and every layer interleaved, the row
    pitch between pages), the request's lookup-table row (padded columns of sentinels), where its pages lie, and
    token -> physical row (jumps of whole row pitches)."""
    import numpy as np
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    n, kvd, nl, p = coll.num_pages, coll.kv_dim, coll.num_layers, coll.page_size
    pitch = kvd * nl * p
    fig = figure_cls(figsize=(13, 8.5), layout="constrained")
    (ax_page, ax_lut), (ax_map, ax_rows) = fig.subplots(2, 2, gridspec_kw={"height_ratios": [1, 2]})

    # One page: KVD x L planes of P rows each, K planes then V planes; the chosen layer's planes stand out.
    colors = ("tab:blue", "tab:orange")
    for kv in range(kvd):
        for lay in range(nl):
            start = (kv * nl + lay) * p
            chosen = lay == layer
            ax_page.add_patch(Rectangle((start, 0), p, 1, facecolor=colors[kv], alpha=1.0 if chosen else 0.3,
                                        edgecolor="k" if chosen else "w", linewidth=1.2 if chosen else 0.3))
            if chosen:
                left = start < 0.75 * pitch  # labels near the right end grow leftwards
                ax_page.text(start if left else start + p, 1.08, f"{'KV'[kv]} l={layer}: rows {start}-{start + p - 1}",
                             ha="left" if left else "right", va="bottom", fontsize=8)
    ax_page.set_xlim(0, pitch)
    ax_page.set_ylim(0, 1.5)
    ax_page.set_yticks([])
    ax_page.set_xlabel(f"row within a page (a row = H*D = {coll.num_heads * coll.head_size} elements)")
    kinds = "K then V" if kvd == 2 else "K only (MLA)"
    page_bytes = pitch * coll.num_heads * coll.head_size * coll.blocks.element_size()
    ax_page.set_title(f"one page: {kvd} x {nl} layers x {p} rows ({kinds})\nrow pitch between pages: "
                      f"KVD*L*P = {pitch} rows = {page_bytes:,} bytes", fontsize=9)

    # The request's lookup-table row: its pages, then sentinel columns up to MAX's padded width.
    lut = make_lookup_table([pages], sentinel=n)[0].to(torch.int64).numpy()
    logical = np.where(lut < n, np.arange(lut.shape[0]), np.nan)[None, :]  # coloured as in the page map below
    ax_lut.set_facecolor("0.75")
    ax_lut.imshow(logical, cmap="viridis", vmin=0, vmax=max(len(pages) - 1, 1), aspect="auto",
                  interpolation="nearest")
    if lut.shape[0] <= 48:
        for j, e in enumerate(lut):
            ax_lut.text(j, 0, "N" if e >= n else str(int(e)), ha="center", va="center", fontsize=7,
                        color="k" if e >= n else "w")
    ax_lut.axvline(len(pages) - 0.5, color="r", linewidth=1.5)
    ax_lut.set_yticks([])
    ax_lut.set_xlabel("lookup_table column (logical page)")
    ax_lut.set_title(f"lookup_table[0] (entries: physical pages): the request's {len(pages)}, then the sentinel "
                     f"N={n}\n(grey, no page) to MAX's padded {lut.shape[0]} columns (ceil(c/8)*8 + 16)", fontsize=9)

    # Where the request's pages lie among the physical pages.
    width = math.ceil(math.sqrt(n))
    height = -(-n // width)
    grid = np.full(width * height, np.nan)
    grid[pages] = np.arange(len(pages))
    ax_map.set_facecolor("0.88")
    im = ax_map.imshow(grid.reshape(height, width), cmap="viridis", vmin=0, vmax=max(len(pages) - 1, 1),
                       interpolation="nearest")
    if n <= 256:
        for logical, phys in enumerate(pages):
            ax_map.text(phys % width, phys // width, str(logical), ha="center", va="center", fontsize=7, color="w")
    ax_map.set_title("physical pages (grey: not the request's)", fontsize=9)
    ax_map.set_xlabel(f"page % {width}")
    ax_map.set_ylabel(f"page // {width}")
    fig.colorbar(im, ax=ax_map, label="logical page").ax.yaxis.set_major_locator(MaxNLocator(integer=True))

    # Token -> row: P consecutive rows, then a jump of whole pitches to the next page.
    ax_rows.plot(np.arange(len(rows)), rows, ".", markersize=2)
    for page in pages:
        ax_rows.axhline(page * pitch, color="0.85", linewidth=0.5, zorder=0)
    ax_rows.set_xlabel("token")
    ax_rows.set_ylabel(f"row (row_idx = page * {pitch} + slot)")
    ax_rows.set_title(f"token -> row of layer {layer}'s K plane ({p} tokens per page)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=100)
