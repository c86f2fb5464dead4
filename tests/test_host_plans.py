"""What the kernels index, evaluated on the host: CuTe DSL host code runs on CPU tensors, so the views and tiles a
kernel builds can be checked element by element without a GPU."""

import pytest
import torch
from cutlass.cute.runtime import from_dlpack

import cutlass
import host_plans
from cute_kv.kernels.attention.row_gather import RowGather
from cute_kv.reference.quant import quantize_fp8

pytestmark = pytest.mark.compile


def _aligned(n, dtype, align=1024):
    """``n`` elements starting on an ``align``-byte boundary (a swizzle acts on address bits)."""
    raw = torch.zeros(n + align, dtype=dtype)
    start = (-raw.data_ptr() % align) // raw.element_size()
    return raw[start:start + n]


def tma_image(values):
    """Shared-memory image of a 16-bit ``(rows, depth)`` tile as TMA writes it with the 128-byte swizzle: boxes of
    64 columns one after another, each row 128 bytes, its 16-byte chunk ``j`` stored at chunk ``j ^ (row % 8)``."""
    rows, depth = values.shape
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(depth), indexing="ij")
    box, col = c // 64, c % 64
    chunk = (col // 8) ^ (r % 8)
    element = box * rows * 64 + r * 64 + chunk * 8 + col % 8
    image = _aligned(rows * depth, values.dtype)
    image[element.flatten()] = values.flatten()
    return image


@pytest.mark.parametrize("rows,depth", [(16, 128), (64, 256), (128, 64)])  # the gather kernel's (P, D) cases
def test_gather_thread_reads_what_tma_wrote(rows, depth):
    """``PagedKVGather`` stores rows of its TMA-written tile from thread reads: with the swizzle on the pointer they
    return each element where TMA put it; with the swizzle inside the layout (the defect) they do not."""
    values = torch.arange(rows * depth, dtype=torch.int16).reshape(rows, depth)  # finite, distinct bf16 bit patterns
    image = from_dlpack(tma_image(values).view(torch.bfloat16))
    got = torch.zeros(rows, depth, dtype=torch.int16)
    host_plans.read_swizzled_tile(image, from_dlpack(got.view(torch.bfloat16)), rows, depth)
    assert torch.equal(got, values)
    host_plans.read_layout_swizzled_tile(image, from_dlpack(got.view(torch.bfloat16)), rows, depth)
    assert got[1, 0] == values[1, 8]  # element (1, 0) read at byte 128, where TMA wrote (1, 8)


@pytest.mark.parametrize("bn,depth", [(128, 64), (128, 128), (64, 256)])  # the SM90 attention's key tiles
def test_row_gather_writes_what_tma_would(bn, depth):
    """The SM90 attention's row gather (pages no TMA box tiles): the pieces its 128 threads copy, at the shared
    addresses it computes by hand (pass 0's piece, then xor and add a constant a pass), make the image TMA writes
    with the 128-byte swizzle, each row from the lane whose lookup the segmented shuffle reads."""
    values = torch.arange(bn * depth, dtype=torch.int16).reshape(bn, depth)  # finite, distinct bf16 bit patterns
    image = _aligned(bn * depth, torch.int16)
    image.fill_(-1)
    gather = RowGather(bn, depth, 1, cutlass.BFloat16, 128)
    host_plans.GatheredStage(gather).fill(from_dlpack(values.view(torch.bfloat16)),
                                          from_dlpack(image.view(torch.bfloat16)))
    assert torch.equal(image, tma_image(values))


def test_row_gather_plans_the_head_dims_the_config_admits():
    """``config.supported`` sends pages no TMA box tiles to the row gather at ``GATHER_HEAD_DIMS`` only: those are
    the head dims (16-bit, values as wide) ``RowGather`` has a plan for at their key tile and ring swizzle."""
    from cute_kv.kernels.attention.config import GATHER_HEAD_DIMS, HEAD_DIMS, key_tile, ring_swizzle

    planned = set()
    for d in HEAD_DIMS:
        try:
            RowGather(key_tile(d, page_size=1), d, 1, cutlass.BFloat16, ring_swizzle(d, False))
            planned.add(d)
        except ValueError:
            pass
    assert planned == set(GATHER_HEAD_DIMS)


def test_dense_operand_honours_the_request_stride():
    """A ``[B, S, H, D]`` cache sliced from a longer one (``stride[0] > S*H*D``): token ``t`` of request ``b`` is row
    ``b * stride[0] / (H*D) + t`` of the operand's view, and the view ends after the last request's ``S`` rows."""
    g = torch.Generator().manual_seed(4)
    b, s, s_alloc, h, d = 3, 37, 50, 2, 64
    cache = torch.randn(b, s_alloc, h, d, generator=g)[:, :s]
    coords = torch.stack([torch.randint(0, n, (200,), generator=g) for n in (b, s, h, d)], dim=1).to(torch.int32)
    coords[0] = torch.tensor([b - 1, s - 1, h - 1, d - 1])  # the view's last element
    got = torch.full((200,), float("nan"))
    num_rows = torch.zeros(1, dtype=torch.int32)
    host_plans.dense_rows(from_dlpack(cache).mark_layout_dynamic(leading_dim=3), from_dlpack(coords),
                          from_dlpack(got), from_dlpack(num_rows))
    want = cache[coords[:, 0].long(), coords[:, 1].long(), coords[:, 2].long(), coords[:, 3].long()]
    assert torch.equal(got, want)
    assert int(num_rows) == (b - 1) * s_alloc + s


def test_flat_scale_extent_is_64_bit():
    """``rows * H * G`` of a large fp8 cache's scales passes 2^31: the flat scale view counts it exactly."""
    n, kvd, nl, p, h, g = 2**22, 2, 1, 16, 8, 8
    scales = torch.zeros(1).as_strided((n, kvd, nl, p, h, g), (0, 0, 0, 0, 0, 0))
    got = torch.zeros(1, dtype=torch.int64)
    host_plans.flat_scale_extent(from_dlpack(scales).mark_layout_dynamic(), from_dlpack(got))
    assert int(got) == ((n - 1) * kvd * nl * p + p) * h * g > 2**32


def test_e8m0_decoding_matches_torch():
    """Every e8m0 byte decodes to torch's float32 bits, bytes 0 (2^-127, a subnormal) and 255 (NaN) included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.zeros(256, dtype=torch.int32)
    host_plans.decode_e8m0(from_dlpack(codes), from_dlpack(got.view(torch.float32)))
    want = codes.view(torch.float8_e8m0fnu).to(torch.float32).view(torch.int32)
    assert torch.equal(got, want)
    assert want[0] == 0x00400000 and want[255] == 0x7F800001


def _amax_cases() -> torch.Tensor:
    """Granule amaxes whose scales (``amax / 448``) cover every e8m0 rounding case: zero, subnormal scales around
    2^-127 and 2^-126, every power of two and its float32 neighbours, random finite values, the largest float32,
    infinity and NaN of either sign."""
    powers = torch.ldexp(torch.full((260,), 448.0), torch.arange(-140, 120))
    near = torch.cat([powers, torch.nextafter(powers, powers * 2), torch.nextafter(powers, powers / 2)])
    bits = torch.randint(0, 0x7F7FFFFF, (4000,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    special = torch.tensor([0.0, 2.0**-149, 448 * 2.0**-127, 448 * 1.5 * 2.0**-127, torch.finfo(torch.float32).max,
                            float("inf"), float("nan"), -float("nan")])
    return torch.cat([near, bits.view(torch.float32), special]).contiguous()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_fp8_scales_match_the_reference_bit_for_bit(scale_dtype):
    """The kernels' scale of a granule (``quant.lanes_scale``, the divisor, and the stored scale) is the reference's
    ``quantize_fp8`` scale bit for bit, for float32 and for e8m0 (power-of-two ceiling, subnormal 2^-127 floor,
    2^127 clamp, NaN byte 255)."""
    amax = _amax_cases()
    e8m0 = scale_dtype == torch.float8_e8m0fnu
    divisors = torch.zeros_like(amax)
    stored = torch.zeros(amax.shape, dtype=torch.int32)
    host_plans.scales_of_amax(from_dlpack(amax), from_dlpack(divisors), from_dlpack(stored.view(torch.float32)
                                                                                    if not e8m0 else stored), e8m0)
    _, want = quantize_fp8(amax.unsqueeze(-1), 1, scale_dtype)
    want = want.squeeze(-1)
    nan = amax.isnan()
    if e8m0:
        assert torch.equal(stored, want.view(torch.uint8).to(torch.int32))
        assert torch.equal(divisors.view(torch.int32)[~nan], want.to(torch.float32).view(torch.int32)[~nan])
        assert stored[nan].eq(255).all() and divisors[nan].isnan().all()
        assert {0, 254} <= set(stored.tolist())  # the 2^-127 floor and the clamp of infinity were reached
    else:
        assert torch.equal(stored[~nan], want[~nan].view(torch.int32))
        assert torch.equal(divisors.view(torch.int32), stored)
        assert stored.view(torch.float32)[nan].isnan().all()


def test_rows_outside_the_cache_are_never_stored():
    """Unchecked metadata: a lookup entry of 2^31 or more (negative as int32), the sentinel ``N``, a column past the
    table and a wrapped position all resolve to page -1; owned pages resolve as the reference says."""
    n, p = 6, 4
    lut = torch.tensor([[3, 0x80000005, 0xFFFFFFFF, n],  # request 0: a page, a huge entry, -1 as uint32, the sentinel
                        [5, 2, 1, 0]], dtype=torch.int64).to(torch.uint32)
    cache_lengths = torch.tensor([0, 0xFFFFFFFE], dtype=torch.int64).to(torch.uint32)  # request 1 wraps past 2^32
    offsets = torch.tensor([0, 18, 21], dtype=torch.int64).to(torch.uint32)  # 18 rows run past request 0's table
    rows = int(offsets[-1])
    got = torch.zeros((rows + 1, 2), dtype=torch.int32)
    host_plans.resolved_rows(from_dlpack(offsets.view(torch.int32)), from_dlpack(cache_lengths.view(torch.int32)),
                             from_dlpack(lut.view(torch.int32)), from_dlpack(got), rows, n, p)
    want = [3] * 4 + [-1] * 14 + [-1, -1, 5] + [-1]  # request 1: positions 2^32-2, 2^32-1 (past the table), 0
    assert got[:, 0].tolist() == want
    assert got[:4, 1].tolist() == [0, 1, 2, 3] and got[20, 1] == 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_qkv_rope_reads_no_position_outside_the_table(interleaved):
    """Unchecked positions (``validate=False``) at or past ``freqs_cis``'s rows, or negative as int32, read no row
    outside the table (the rows around it here hold finite values such a read would use): what they would rotate
    is NaN. Positions inside the table rotate as the reference does."""
    from cute_kv import RopeConfig
    from cute_kv.kernels.qkv.gemm import QKVSpec
    from cute_kv.reference.rope import apply_rope
    from numerics import rel_err

    head, positions, bm, bn = 64, 100, 128, 128
    spec = QKVSpec("bfloat16", bn, 2, 16, 1, head, head, False, (head, interleaved))  # a tile of two Q heads
    g = torch.Generator().manual_seed(5)
    staged = torch.randn(bm, bn, generator=g)
    table = RopeConfig.from_theta(head, positions + 20).freqs_cis
    rope = RopeConfig(table[10:10 + positions], interleaved)  # rows 10 before and after it: finite cos/sin
    pos = torch.randint(0, positions, (bm,), generator=g, dtype=torch.int32)
    outside = torch.tensor([5, 9, 11, 12])
    pos[outside] = torch.tensor([positions, positions + 9, -3, -1], dtype=torch.int32)
    out = torch.full((bm, bn), float("nan"), dtype=torch.bfloat16)
    blocks = torch.zeros(1, 2, 1, 16, 1, head, dtype=torch.bfloat16)
    no_page = torch.full((bm,), -1, dtype=torch.int32)
    host_plans.fused_qkv_rope_tile(spec, from_dlpack(staged), from_dlpack(no_page), from_dlpack(pos),
                                   from_dlpack(out), from_dlpack(blocks), from_dlpack(rope.freqs_cis), 0, 128)
    inside = torch.ones(bm, dtype=torch.bool)
    inside[outside] = False
    want = apply_rope(staged.unflatten(1, (-1, head)), pos.clamp(0, positions - 1).long(), rope).flatten(1)
    assert rel_err(out[inside].float(), want[inside]) < 1e-2
    assert out[~inside].isnan().all()
    assert not blocks.any()  # no row had a page


def test_attention_rows_stay_inside_the_step():
    """Unchecked offsets (validate=False): a request past the step's rows, decreasing offsets and offsets of 2^31 or
    more (negative as int32) give the attention kernels fewer or no rows, never a row of q or the output past T."""
    t = 8
    offsets = torch.tensor([0, 3, 2, 10, 0x80000000, 12, 0xFFFFFFFF, 5], dtype=torch.int64).to(torch.uint32)
    got = torch.full((offsets.numel() - 1, 2), -7, dtype=torch.int32)
    host_plans.attention_request_rows(from_dlpack(offsets.view(torch.int32)), from_dlpack(got), t)
    assert got.tolist() == [[0, 3], [3, 0], [2, 6], [8, 0], [8, 0], [8, 0], [8, 0]]
    starts, counts = got.T
    assert bool(((starts >= 0) & (counts >= 0) & (starts + counts <= t)).all())
    # well-formed offsets are untouched
    good = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    got = torch.zeros((3, 2), dtype=torch.int32)
    host_plans.attention_request_rows(from_dlpack(good), from_dlpack(got), t)
    assert got.tolist() == [[0, 3], [3, 0], [3, 5]]


@pytest.mark.parametrize("lut_vector", [True, False])
def test_attention_tiles_never_read_past_the_lookup_row(lut_vector):
    """Unchecked lengths (validate=False): a tile slot whose column lies past the lookup table's row gets the
    out-of-bounds row (TMA zero-fills it) and the entries past the row (here the next columns of a wider buffer) are
    not read; slots inside the row read their entries."""
    cols, p, bn, rpp, oob = 4, 16, 64, 48, 10_000
    buf = torch.full((2, 2 * cols), 7, dtype=torch.int32)  # 7: what lies past each row
    buf[:, :cols] = torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]])
    lut = buf[:, :cols]
    got = torch.zeros(bn // p, dtype=torch.int32)
    for b, base, keys, want in ((1, 0, 500, [1, 3, 0, 2]), (1, 64, 500, [oob] * 4), (0, 64, 500, [oob] * 4),
                                (0, 0, 40, [2, 0, 3, oob])):
        host_plans.attention_tile_rows(from_dlpack(lut), from_dlpack(got), b, base, keys, rpp, oob, bn, p, lut_vector)
        assert got.tolist() == [r if r == oob else r * rpp for r in want], (b, base, keys)


@pytest.mark.parametrize("bn, page_size", [(112, 64), (80, 48), (112, 128)])
def test_attention_tiles_of_partial_pages(bn, page_size):
    """A key tile neither dividing nor divided by the page (FA4's 112 and 80 keys over pages of 48, 64, 128) loads
    slots of ``gcd`` rows, each inside one page: slot ``i`` of the tile at ``base`` is the row of key ``base + i *
    slot`` (its page's entry times the pitch, plus the offset in the page); slots at or past the keys, or whose page
    column lies past the lookup row, get the out-of-bounds row (entries past the row, 7 here, never read)."""
    from cute_kv.kernels.attention.config import page_slot

    slot, rpp, oob = page_slot(page_size, bn), 3 * page_size, 10_000
    cols = 5
    buf = torch.full((2, 2 * cols), 7, dtype=torch.int32)
    buf[:, :cols] = torch.stack([torch.randperm(cols), torch.randperm(cols)]).to(torch.int32) + 11
    lut = buf[:, :cols]
    got = torch.zeros(bn // slot, dtype=torch.int32)
    for b, base, keys in ((1, 0, 500), (0, bn, 500), (1, 2 * bn, bn * 2 + 17), (0, 3 * bn, 3 * bn - 1),
                          (1, 4 * bn, 10 * bn)):
        host_plans.attention_tile_rows(from_dlpack(lut), from_dlpack(got), b, base, keys, rpp, oob, bn, page_size,
                                       True)
        want = [int(lut[b, k // page_size]) * rpp + k % page_size if k < keys and k // page_size < cols else oob
                for k in range(base, base + bn, slot)]
        assert got.tolist() == want, (b, base, keys)


def test_gather4_key_rows_never_read_past_the_lookup_row():
    """The gather4 paths (SM100 attention over small or uneven pages, MLA): a key whose page column lies past the
    lookup table's row (unchecked lengths) gets the out-of-bounds row and the entries past the row (the next columns
    of a wider buffer) are not read; keys past ``num_keys`` too; the others read their entry."""
    cols, p, rpp, oob = 3, 4, 48, 10_000
    buf = torch.full((2, 2 * cols), 7, dtype=torch.int32)  # 7: what lies past each row
    buf[:, :cols] = torch.tensor([[2, 0, 3], [1, 3, 0]])
    got = torch.full((2 * cols * p,), -5, dtype=torch.int32)
    for b, keys in ((1, 2 * cols * p), (0, 5)):
        host_plans.attention_key_rows(from_dlpack(buf[:, :cols]), from_dlpack(got), b, keys, rpp, oob, p, got.numel())
        want = [int(buf[b, k // p]) * rpp + k % p if k < min(keys, cols * p) else oob for k in range(got.numel())]
        assert got.tolist() == want, (b, keys)


def test_attention_scales_of_rows_outside_the_view_are_not_read():
    """fp8 dequantization: a row that is not in the scale view (an unchecked lookup entry that is not a page, its
    row product wrapped negative or past the view) reads no scale and gets 0; rows inside read theirs."""
    rows, h, g = 6, 2, 4
    buf = torch.full((3 * rows, h, g), 99.0)  # 99: what lies before and after the view
    view = buf[rows:2 * rows]
    view.copy_(torch.arange(rows * h * g, dtype=torch.float32).reshape(rows, h, g))
    which = torch.tensor([0, 5, 6, 11, -1, -6, -2**31], dtype=torch.int32)
    got = torch.full((which.numel(),), -1.0)
    host_plans.attention_scales(from_dlpack(view), from_dlpack(which), from_dlpack(got), which.numel())
    assert got.tolist() == [float(0 * h * g + g), float(5 * h * g + g)] + [0.0] * 5


@pytest.mark.parametrize("layout", ["compact", "vllm", "flashinfer-hnd", "separate"])
def test_row_gather_reads_the_planes_own_strides(layout):
    """The gather's source of row ``r`` (``page * sN/sP + slot``), head ``h``, lane ``l`` is element ``r*sP + h*sH +
    (l % chunks) * 8`` of the plane: an engine's layout (HND's heads ``P*D`` apart) is read in place, with pages of one
    token (SGLang) among them."""
    from cute_kv.kv_layout import engine_kv

    n, p, h, d = 3, 1, 2, 128
    if layout == "compact":
        plane = torch.zeros(n, 2, 1, p, h, d, dtype=torch.bfloat16)[:, 0]
    else:
        k, _ = engine_kv(layout, n, p, h, d, torch.bfloat16)
        plane = k.unsqueeze(1)  # [N, L=1, P, H, D]
    s_n, _, s_p, s_h, _ = plane.stride()
    gather = RowGather(128, d, p, cutlass.BFloat16, 128)
    rows = (n - 1) * (s_n // s_p) + p
    offsets = torch.full((rows, h, 32), -1, dtype=torch.int32)
    host_plans.GatherSources(gather).fill(from_dlpack(plane).mark_layout_dynamic(leading_dim=4),
                                          from_dlpack(offsets))
    r, hh, lane = torch.meshgrid(torch.arange(rows), torch.arange(h), torch.arange(32), indexing="ij")
    assert torch.equal(offsets, (r * s_p + hh * s_h + lane % gather.chunks * gather.vec).to(torch.int32))


def test_row_gather_copies_no_row_outside_the_cache():
    """Unchecked metadata (``validate=False``) may hold lookup entries that name no page (MAX's sentinel ``N``, or
    anything larger): cp.async has no TMA zero fill, so those keys, like keys past ``num_keys``, get no copy (-1)."""
    n, pitch = 4, 2  # pages of one token, K and V: rows 0..6 of the plane
    num_rows = (n - 1) * pitch + 1
    gather = RowGather(128, 128, 1, cutlass.BFloat16, 128)
    lut = torch.tensor([[0, 1, 2, n, 2**31 - 1, 2**32 - 1, 3, 1] + [0] * 120], dtype=torch.int64).to(torch.uint32)
    rows = torch.zeros((4, 32), dtype=torch.int32)
    host_plans.GatherRows(gather).fill(from_dlpack(lut), from_dlpack(rows), 7, pitch, num_rows)
    assert rows[0, :8].tolist() == [0, 2, 4, -1, -1, -1, 6, -1]  # key 7 is past num_keys


@pytest.mark.parametrize("d,page_size,want", [(256, 20, 64), (256, 60, 64), (256, 40, 64), (192, 28, None),
                                              (192, 56, None), (192, 64, 112), (256, 48, 80)])
def test_wide_key_tiles_only_over_slots_of_16_rows(d, page_size, want):
    """80- and 112-key tiles over pages whose slot (gcd(P, tile)) is not a multiple of 16 rows: 20 or 28 rows are not
    whole 8-row swizzle atoms, so no TMA box matches the staged tile. Such pages gather rows at 64 keys where the
    gather takes the head dim (256), and are refused at 192, before anything is compiled."""
    from cute_kv.kernels.attention.config import gathers, key_tile, supported

    if want is None:
        assert "must be a multiple of 16" in supported(8, 1, d, page_size, "bfloat16")
        return
    assert supported(8, 1, d, page_size, "bfloat16") is None
    assert key_tile(d, page_size=page_size) == want
    assert gathers(page_size, want) == (page_size % 16 != 0)
