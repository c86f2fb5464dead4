"""Exact data-movement and tensor-core layout maps of sm_90a, as pure numpy functions.

Nothing here touches memory: each function says *where* (a shared/global byte address) or *which* ((row, col)
of a matrix) an element is, for the core to read/write/check. Section numbers are those of the PTX ISA 8.8
(the same sections exist in 9.0, renumbered by at most one minor level).

Contents
  * ``swizzle_addr``                       the 32/64/128-byte swizzle on absolute shared addresses.
  * ``smem_desc_decode`` / ``SmemDesc``     the 64-bit wgmma matrix descriptor.
  * ``wgmma_operand_addrs``                 shared address of each (row, k) element of a wgmma A/B operand.
  * ``wgmma_acc_map``                       (row, col) of each accumulator register element (D / C).
  * ``wgmma_a_reg_map``                     (row, k) of each element of A fragment registers.
  * ``tma_box_addrs``                       global/shared addresses of a cp.async.bulk.tensor tile-mode box.
  * ``ldmatrix_map`` / ``stmatrix_map``     lanes providing row addresses and (matrix,row,col) of each register half.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import MemoryFault, Unsupported
from .tensormap import TensorMap

# ----------------------------------------------------------------------------------------------------------------
# Swizzle
# ----------------------------------------------------------------------------------------------------------------

#: swizzle span (bytes) -> number of 16-byte chunk bits XORed (CuTe Swizzle<B,4,3> on byte addresses)
_SWIZZLE_BITS = {0: 0, 32: 1, 64: 2, 128: 3}


def swizzle_addr(addr, swizzle: int):
    """The shared-memory swizzle of PTX ISA 5.5 "Tensors" (swizzling modes) (TMA) and 9.7.15.5.1.2
    "Shared Memory Matrix Layout" (wgmma canonical layouts), applied to *absolute* shared byte addresses.

    The 16-byte chunk index within a ``swizzle``-byte row (address bits [4, 4+B)) is XORed with the row index
    within the repeating pattern (bits [7, 7+B)), B = log2(swizzle/16):
      128B: bits[4:7) ^= bits[7:10)  (pattern repeats every 1024 bytes)
       64B: bits[4:6) ^= bits[7:9)   (every 512 bytes)
       32B: bit 4     ^= bit 7       (every 256 bytes)
       0  : identity.
    This is CuTe's ``Swizzle<B,4,3>`` evaluated on byte addresses. Works on ints and int64 arrays.
    """
    if swizzle not in _SWIZZLE_BITS:
        raise Unsupported(f"swizzle span {swizzle} bytes (PTX ISA 5.5 swizzling modes: only none/32B/64B/128B)")
    b = _SWIZZLE_BITS[swizzle]
    if b == 0:
        return addr
    mask = ((1 << b) - 1) << 7
    return addr ^ ((addr & mask) >> 3)


# ----------------------------------------------------------------------------------------------------------------
# wgmma matrix descriptor
# ----------------------------------------------------------------------------------------------------------------

#: descriptor layout_type field (bits 62-63) -> swizzle span in bytes
_LAYOUT_TYPE_SWIZZLE = {0: 0, 1: 128, 2: 64, 3: 32}


@dataclasses.dataclass(frozen=True)
class SmemDesc:
    start_addr: int   # bytes (field << 4)
    lbo: int          # leading dimension byte offset, bytes (field << 4)
    sbo: int          # stride dimension byte offset, bytes (field << 4)
    base_offset: int  # 3-bit matrix base offset
    swizzle: int      # 0 (none / "interleave"), 32, 64 or 128 bytes


def smem_desc_decode(desc: int) -> SmemDesc:
    """Decode the 64-bit wgmma shared-memory matrix descriptor, PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix
    Layout" / "Matrix Descriptor Format" (sm_90 wgmma form; the tcgen05 descriptor of sm_100 differs).

      bits  0-13  matrix start address  >> 4      bits 16-29  leading dimension byte offset >> 4
      bits 32-45  stride dimension byte offset >> 4
      bits 49-51  matrix base offset               bits 62-63  swizzle: 0 none, 1 128B, 2 64B, 3 32B
    Same bitfields as CUTLASS ``cute::GmmaDescriptor`` (cute/arch/mma_sm90_desc.hpp). Other bits are ignored.
    """
    desc = int(desc) & 0xFFFF_FFFF_FFFF_FFFF
    return SmemDesc(
        start_addr=(desc & 0x3FFF) << 4,
        lbo=((desc >> 16) & 0x3FFF) << 4,
        sbo=((desc >> 32) & 0x3FFF) << 4,
        base_offset=(desc >> 49) & 0x7,
        swizzle=_LAYOUT_TYPE_SWIZZLE[(desc >> 62) & 0x3],
    )


def smem_desc_encode(start_addr: int, lbo: int, sbo: int, swizzle: int, base_offset: int = 0) -> int:
    """Inverse of ``smem_desc_decode`` (PTX ISA 9.7.15.5.1.2 Matrix Descriptor Format); byte values must be
    multiples of 16 below 2**18."""
    for name, v in (("start_addr", start_addr), ("lbo", lbo), ("sbo", sbo)):
        if v % 16 or not 0 <= v < (1 << 18):
            raise ValueError(f"{name}={v}: must be a multiple of 16 below 2**18")
    lt = {0: 0, 128: 1, 64: 2, 32: 3}[swizzle]
    return ((start_addr >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | ((base_offset & 7) << 49)
            | (lt << 62))


def wgmma_operand_addrs(desc: int, rows: int, kcols: int, elem_bits: int, k_major: bool) -> np.ndarray:
    """Shared byte address of element (row, k) of one wgmma's A (rows = M = 64) or B (rows = N) operand read
    through a matrix descriptor: PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix Layout" (canonical layouts,
    "Matrix Descriptor Format"). k_major = not imm-trans-a (resp. imm-trans-b): 0 = K-major for both A and B.

    Returns int64 (rows, kcols); for 8/16/32-bit elements, the address of the element's first byte.
    With T = 16 bytes (one core-matrix row), in bytes, r = row, kb = k*elem_bytes, mb = row*elem_bytes
    (the ISA's canonical layouts, CuTe notation, converted to bytes):
      K-major, no swizzle : (r%8)*16  + (r//8)*SBO + kb%16 + (kb//16)*LBO
      K-major, W-byte swz : (r%8)*W   + (r//8)*SBO + kb              (LBO unused; the K extent, 32 B, fits in W)
      MN-major, no swizzle: mb%16 + (mb//16)*SBO + (k%8)*16 + (k//8)*LBO
      MN-major, W-byte swz: mb%W  + (mb//W)*LBO  + (k%8)*W  + (k//8)*SBO
    all added to the start address, then ``swizzle_addr`` on the absolute address (the pattern is anchored at
    1024/512/256-byte boundaries of the shared window; with base_offset = 0 that is what CUTLASS assumes:
    its buffers are pattern-aligned and it advances the start address by the K offset inside a row).

    kcols must be the instruction's K in elements: 32 bytes (16 for 16-bit, 32 for 8-bit, 8 for tf32).
    MN-major ("transposed", imm-trans-a/b = 1) is valid only for .f16/.bf16 (ISA 9.7.15.5: transpose
    is supported only for 16-bit types); other sizes raise Unsupported. A nonzero base_offset raises Unsupported
    (its effect on the pattern phase is not modelled).
    """
    d = smem_desc_decode(desc)
    if elem_bits not in (8, 16, 32):
        raise Unsupported(f"wgmma operand of {elem_bits}-bit elements (PTX ISA 9.7.15.5.1.2)")
    eb = elem_bits // 8
    if kcols * eb != 32:
        raise Unsupported(f"wgmma operand K = {kcols} x {elem_bits}-bit: the dense wgmma K extent is 32 bytes")
    if rows % 8:
        raise Unsupported(f"wgmma operand with {rows} rows (must be a multiple of 8)")
    if d.base_offset != 0:
        raise Unsupported(f"wgmma matrix descriptor base_offset = {d.base_offset} (PTX ISA 9.7.15.5.1.2 Matrix "
                          "Descriptor Format; only 0 is modelled)")
    r = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(kcols, dtype=np.int64)[None, :]
    W = d.swizzle
    if k_major:
        kb = k * eb
        if W == 0:
            off = (r % 8) * 16 + (r // 8) * d.sbo + kb % 16 + (kb // 16) * d.lbo
        else:
            off = (r % 8) * W + (r // 8) * d.sbo + kb
    else:
        if elem_bits != 16:
            raise Unsupported(f"MN-major (transposed) wgmma operand of {elem_bits}-bit elements "
                              "(PTX ISA 9.7.15.5: transpose only for .f16/.bf16)")
        mb = r * eb
        if W == 0:
            off = mb % 16 + (mb // 16) * d.sbo + (k % 8) * 16 + (k // 8) * d.lbo
        else:
            off = mb % W + (mb // W) * d.lbo + (k % 8) * W + (k // 8) * d.sbo
    return swizzle_addr(d.start_addr + off, W).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# wgmma register fragments
# ----------------------------------------------------------------------------------------------------------------

def wgmma_acc_map(n: int, acc_bits: int) -> np.ndarray:
    """(row, col) of each accumulator element of ``wgmma.mma_async.m64nNk*``: PTX ISA 9.7.15.5.1.1 "Register
    Fragments" (figure "WGMMA .m64nNk* register fragment layout for accumulator matrix D").

    Warp w of the warpgroup owns rows 16w..16w+15; in lane l, element i (i = 0 .. n/2-1, in register order for
    32-bit accumulators) is at
        row = 16w + l//4 + 8*((i//2) % 2),   col = 8*(i//4) + 2*(l%4) + i%2.
    acc_bits = 32 (.f32 / .s32): shape (4, 32, n//2, 2): [warp, lane, reg] -> (row, col).
    acc_bits = 16 (.f16): n//4 32-bit registers each holding two f16 (low half = even i, high half = odd i):
        shape (4, 32, n//4, 2, 2): [warp, lane, reg, half(0 low, 1 high)] -> (row, col).
    """
    if n % 8 or not 8 <= n <= 256:
        raise Unsupported(f"wgmma N = {n} (PTX ISA 9.7.15.5: N is a multiple of 8 in [8, 256])")
    w = np.arange(4)[:, None, None]
    ln = np.arange(32)[None, :, None]
    i = np.arange(n // 2)[None, None, :]
    row = 16 * w + ln // 4 + 8 * ((i // 2) % 2)
    col = 8 * (i // 4) + 2 * (ln % 4) + i % 2
    rc = np.stack(np.broadcast_arrays(row, col), axis=-1).astype(np.int64)  # (4, 32, n/2, 2)
    if acc_bits == 32:
        return rc
    if acc_bits == 16:
        return rc.reshape(4, 32, n // 4, 2, 2)
    raise Unsupported(f"wgmma accumulator of {acc_bits} bits (PTX ISA 9.7.15.5.1.1: .f32, .s32 or .f16)")


def wgmma_a_reg_map(elem_bits: int) -> np.ndarray:
    """(row, k) of each element packed in the A fragment registers of ``wgmma.mma_async`` with A in registers:
    PTX ISA 9.7.15.5.1.1 "Register Fragments" (figures "WGMMA .m64nNk16 / .m64nNk32 / .m64nNk8 register fragment
    layout for matrix A").

    Four 32-bit registers a0..a3 per thread; per_reg = 32/elem_bits elements, element j of register a_i in bits
    [j*elem_bits, (j+1)*elem_bits). In warp w, lane l (g = l//4, t = l%4):
        row = 16w + g + 8*(i % 2),   k = (i//2) * (K/2) + t*per_reg + j      (K = 256/elem_bits)
    elem_bits 16 (.f16/.bf16, k16), 8 (.e4m3/.e5m2/.s8/.u8, k32), 32 (.tf32, k8).
    Returns int64 (4, 32, 4, per_reg, 2): [warp, lane, reg, element] -> (row, k).
    """
    if elem_bits not in (8, 16, 32):
        raise Unsupported(f"wgmma A fragment of {elem_bits}-bit elements (PTX ISA 9.7.15.5.1.1)")
    per = 32 // elem_bits
    K = 256 // elem_bits
    w = np.arange(4)[:, None, None, None]
    ln = np.arange(32)[None, :, None, None]
    i = np.arange(4)[None, None, :, None]
    j = np.arange(per)[None, None, None, :]
    row = 16 * w + ln // 4 + 8 * (i % 2)
    k = (i // 2) * (K // 2) + (ln % 4) * per + j
    return np.stack(np.broadcast_arrays(row, k), axis=-1).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# TMA (cp.async.bulk.tensor, tile mode)
# ----------------------------------------------------------------------------------------------------------------

#: shared-memory alignment of a cp.async.bulk.tensor destination/source: 128 bytes (PTX ISA 9.7.9.24), and
#: for swizzled boxes the swizzle pattern's repeat (CUDA Programming Guide, TMA swizzle: 1024 B for 128B, ...).
TMA_SMEM_ALIGN = {0: 128, 32: 256, 64: 512, 128: 1024}


def tma_box_shape(tmap: TensorMap) -> tuple[int, ...]:
    """Elements of the box in shared memory per dimension (innermost first): ceil(box_i / elem_strides_i)
    (PTX ISA 5.5 "Tensors", traversal stride: with stride s only every s-th element is moved)."""
    return tuple(-(-b // s) for b, s in zip(tmap.box, tmap.elem_strides))


def tma_box_addrs(tmap: TensorMap, coords: tuple[int, ...], smem_dst: int):
    """Element maps of one tile-mode ``cp.async.bulk.tensor`` (PTX ISA 9.7.9.24 "cp.async.bulk.tensor" and
    5.5 "Tensors": tile-mode bounding box, traversal stride, out-of-bound access,
    swizzling modes). Same map for loads (global -> shared) and stores (shared -> global, also
    cp.reduce.async.bulk.tensor): ``smem_dst`` is the shared destination (load) resp. source (store).

    Box element j = (j_0, .., j_{r-1}) (j_i < ceil(box_i/elem_strides_i), innermost first, flattened with j_0
    fastest) has tensor coordinate c_i = coords_i + j_i*elem_strides_i;
      gaddr    = tmap.address + sum_i c_i*strides_i           (meaningful only where in_bounds)
      in_bounds = all(0 <= c_i < dims_i)  (out-of-bound elements: loads fill zero/NaN, stores skip; the core's job)
      saddr    = swizzle_addr(smem_dst + elem_bytes * flat(j), tmap.swizzle)  (box dense in smem, innermost dim
                 contiguous; the swizzle pattern on absolute shared address bits)
    Returns (gaddr int64 (n,), in_bounds bool (n,), saddr int64 (n,)), n = prod(tma_box_shape(tmap)).

    Checks (raise naming the rule): rank/coords agree; interleave none; elem_bytes >= 1 (sub-byte types are
    Unsupported); inner box bytes a multiple of 16 (MemoryFault); with swizzle, inner box bytes == swizzle span
    (> span is illegal -> MemoryFault; < span Unsupported: the padding of short rows is not modelled); smem
    address aligned to TMA_SMEM_ALIGN[swizzle] (MemoryFault).
    """
    rank = tmap.rank
    if len(coords) != rank:
        raise Unsupported(f"cp.async.bulk.tensor with {len(coords)} coordinates on a rank-{rank} tensor map")
    if tmap.interleave:
        raise Unsupported(f"TMA interleave layout {tmap.interleave} (PTX ISA 5.5; only non-interleaved)")
    if tmap.elem_bytes < 1:
        raise Unsupported(f"TMA of sub-byte type {tmap.dtype}")
    eb = tmap.elem_bytes
    shape = tma_box_shape(tmap)
    inner_bytes = shape[0] * eb
    if inner_bytes % 16:
        raise MemoryFault(f"TMA box inner dimension {shape[0]} x {eb} B = {inner_bytes} B is not a multiple of 16 "
                          "bytes (PTX ISA 5.5 bounding box; cuTensorMapEncodeTiled)")
    sw = tmap.swizzle
    if sw not in _SWIZZLE_BITS:
        raise Unsupported(f"TMA swizzle {sw}")
    if sw:
        if inner_bytes > sw:
            raise MemoryFault(f"TMA box inner dimension {inner_bytes} B exceeds the {sw}B swizzle span "
                              "(PTX ISA 5.5 swizzling modes: inner box bytes <= swizzle span)")
        if inner_bytes < sw:
            raise Unsupported(f"TMA box inner dimension {inner_bytes} B below the {sw}B swizzle span "
                              "(short swizzled rows not modelled)")
    align = TMA_SMEM_ALIGN[sw]
    if smem_dst % align:
        raise MemoryFault(f"cp.async.bulk.tensor shared address {smem_dst:#x} not {align}-byte aligned "
                          f"(PTX ISA 9.7.9.24: 128 B; swizzle {sw}B pattern repeat {align} B)")
    # j grids, innermost first, flattened with j_0 fastest
    grids = np.meshgrid(*[np.arange(s, dtype=np.int64) for s in reversed(shape)], indexing="ij")
    js = [g.reshape(-1) for g in reversed(grids)]  # js[i] = j_i per element, flat order j_0 fastest
    n = math.prod(shape)
    gaddr = np.full(n, int(tmap.address), dtype=np.int64)
    inb = np.ones(n, dtype=bool)
    flat = np.zeros(n, dtype=np.int64)
    pitch = 1
    for i in range(rank):
        c = int(coords[i]) + js[i] * int(tmap.elem_strides[i])
        gaddr += c * int(tmap.strides[i])
        inb &= (c >= 0) & (c < int(tmap.dims[i]))
        flat += js[i] * pitch
        pitch *= shape[i]
    saddr = swizzle_addr(int(smem_dst) + flat * eb, sw).astype(np.int64)
    return gaddr, inb, saddr


# ----------------------------------------------------------------------------------------------------------------
# ldmatrix / stmatrix
# ----------------------------------------------------------------------------------------------------------------

def ldmatrix_map(num: int, trans: bool, elem_bits: int = 16, shape: str = "m8n8"):
    """Lane maps of ``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX ISA 9.7.14.5.15 "ldmatrix").

    Returns (addr_lane, dst):
      addr_lane int64 (num, 8): the lane whose address operand gives row r of matrix m: lane 8m + r (lanes 0-7
        matrix 0, 8-15 matrix 1, ...; for .x1 lanes 0-7, .x2 lanes 0-15 are used). Each row is 8 contiguous b16
        (16 bytes; the row address must be 16-byte aligned).
      dst int64 (32, num, 2, 3): destination register m (m < num) of lane l, half h (0 = low 16 bits) receives
        (matrix m, row, col) of the matrix as stored (row = the addressed row, col = b16 index within it):
          plain  : row = l//4,         col = 2*(l%4) + h
          .trans : row = 2*(l%4) + h,  col = l//4
        so its byte address is addr[addr_lane[m, row]] + 2*col.
    Only .m8n8 .b16; the .m16n16/.m8n16 .b8/.b6/.b4 shapes (sm_100a) raise Unsupported.
    """
    if shape != "m8n8" or elem_bits != 16:
        raise Unsupported(f"ldmatrix/stmatrix .{shape} with {elem_bits}-bit elements (only .m8n8 .b16)")
    if num not in (1, 2, 4):
        raise Unsupported(f"ldmatrix/stmatrix .x{num}")
    addr_lane = (8 * np.arange(num)[:, None] + np.arange(8)[None, :]).astype(np.int64)
    ln = np.arange(32)[:, None, None]
    m = np.arange(num)[None, :, None]
    h = np.arange(2)[None, None, :]
    if trans:
        row, col = 2 * (ln % 4) + h, ln // 4
    else:
        row, col = ln // 4, 2 * (ln % 4) + h
    dst = np.stack(np.broadcast_arrays(m, row, col), axis=-1).astype(np.int64)
    return addr_lane, dst


def stmatrix_map(num: int, trans: bool, elem_bits: int = 16, shape: str = "m8n8"):
    """Lane maps of ``stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX ISA 9.7.14.5.16
    "stmatrix", next to 9.7.14.5.15 ldmatrix): the inverse direction of ldmatrix with the same fragment:
    source register m, half h of lane l is written to (matrix m, row, col) = ``ldmatrix_map(...)[1][l, m, h]``,
    at addr[addr_lane[m, row]] + 2*col.
    Returns the same (addr_lane, src) pair as ``ldmatrix_map``."""
    return ldmatrix_map(num, trans, elem_bits, shape)


# ----------------------------------------------------------------------------------------------------------------
# sm_100a (tcgen05): shared-memory matrix descriptor, instruction descriptor, TMEM data-movement maps
# Section numbers are those of the PTX ISA 9.1 (9.7.16 "TensorCore 5th Generation Family Instructions").
# ----------------------------------------------------------------------------------------------------------------

#: tcgen05 descriptor swizzling mode (bits 61-63) -> swizzle span in bytes; 1 (128B with 32B atomicity) is separate
_UMMA_LAYOUT_SWIZZLE = {0: 0, 2: 128, 4: 64, 6: 32}
UMMA_SWIZZLE_128B_BASE32B = 1


@dataclasses.dataclass(frozen=True)
class UmmaSmemDesc:
    start_addr: int   # bytes (field << 4)
    lbo: int          # leading dimension byte offset, bytes (field << 4)
    sbo: int          # stride dimension byte offset, bytes (field << 4)
    version: int      # bits 46-48: the ISA fixes them to 0b001
    base_offset: int  # bits 49-51
    lbo_mode: int     # bit 52: 0 byte offset relative, 1 byte address absolute (sm_103a)
    layout: int       # bits 61-63, raw swizzling mode
    swizzle: int      # span in bytes (0 none, 32, 64, 128); -1 for 128B_BASE32B


def umma_smem_desc_decode(desc: int) -> UmmaSmemDesc:
    """The 64-bit tcgen05 shared memory descriptor, PTX ISA 9.1 9.7.16.4.1 "Shared memory descriptor" (Table 40):

      bits  0-13  matrix start address >> 4         bits 16-29  leading dimension byte offset >> 4
      bits 32-45  stride dimension byte offset >> 4   bits 46-48  fixed constant 0b001
      bits 49-51  matrix base offset                  bit  52     leading dimension stride mode
      bits 53-60  fixed 0                             bits 61-63  swizzling mode: 0 none, 1 128B with 32B atomic,
                                                                  2 128B, 4 64B, 6 32B (3, 5, 7 invalid)
    where matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4. Same bitfields as CUTLASS ``cute::UMMA::SmemDescriptor``
    (cute/arch/mma_sm100_desc.hpp: version_ = 1 at bits [46,48), lbo_mode_ at 52, layout_type_ at [61,64)).
    Raises ``Hazard`` for a descriptor the ISA calls invalid (fixed bits wrong, swizzle 3/5/7)."""
    from .errors import Hazard
    desc = int(desc) & 0xFFFF_FFFF_FFFF_FFFF
    version = (desc >> 46) & 0x7
    layout = (desc >> 61) & 0x7
    if version != 1 or (desc >> 53) & 0xFF:
        raise Hazard(f"tcgen05 shared memory descriptor {desc:#018x}: bits 46-48 must be 0b001 and bits 53-60 zero "
                     f"(PTX ISA 9.7.16.4.1 Table 40)")
    if layout in (3, 5, 7):
        raise Hazard(f"tcgen05 shared memory descriptor {desc:#018x}: swizzling mode {layout} is invalid "
                     f"(PTX ISA 9.7.16.4.1 Table 40)")
    return UmmaSmemDesc(
        start_addr=(desc & 0x3FFF) << 4,
        lbo=((desc >> 16) & 0x3FFF) << 4,
        sbo=((desc >> 32) & 0x3FFF) << 4,
        version=version,
        base_offset=(desc >> 49) & 0x7,
        lbo_mode=(desc >> 52) & 1,
        layout=layout,
        swizzle=_UMMA_LAYOUT_SWIZZLE.get(layout, -1),
    )


def umma_smem_desc_encode(start_addr: int, lbo: int, sbo: int, swizzle: int, base_offset: int = 0) -> int:
    """Inverse of ``umma_smem_desc_decode`` for the relative-LBO modes (what CUTLASS ``make_umma_desc`` writes)."""
    for name, v in (("start_addr", start_addr), ("lbo", lbo), ("sbo", sbo)):
        if v % 16 or not 0 <= v < (1 << 18):
            raise ValueError(f"{name}={v}: must be a multiple of 16 below 2**18")
    lt = {0: 0, 128: 2, 64: 4, 32: 6}[swizzle]
    return ((start_addr >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 46) | ((base_offset & 7) << 49)
            | (lt << 61))


def umma_operand_addrs(desc: int, rows: int, kcols: int, elem_bits: int, k_major: bool) -> np.ndarray:
    """Shared byte address of element (row, k) of a tcgen05.mma A (rows = M) or B (rows = N) operand read through a
    shared memory descriptor: PTX ISA 9.1 9.7.16.10.6 "Shared Memory Layout and Swizzling" (the canonical layouts,
    which are those of wgmma: CUTLASS make_umma_desc documents them as
      K-major : Swizzle<B,4,3> o ((8,m),(T,2)):((W/16 T, SBO),(1, LBO or T))
      MN-major: Swizzle<B,4,3> o ((T,W/16,m),(8,k)):((1,T,LBO),(W/16 T,SBO))   (no swizzle: SBO and LBO swap)
    in units of T = 16 bytes). k_major = not "Transpose A/B" of the instruction descriptor (9.7.16.10.6).

    In bytes, r = row, kb = k*elem_bytes, mb = row*elem_bytes, W = swizzle span:
      K-major, no swizzle : (r%8)*16 + (r//8)*SBO + kb%16 + (kb//16)*LBO
      K-major, W swizzle  : (r%8)*W  + (r//8)*SBO + kb
      MN-major, no swizzle: mb%16 + (mb//16)*SBO + (k%8)*16 + (k//8)*LBO
      MN-major, W swizzle : mb%W  + (mb//W)*LBO  + (k%8)*W  + (k//8)*SBO
    added to the start address, then ``swizzle_addr`` on the absolute address (pattern anchored at 1024/512/256-byte
    boundaries, Table 41). Not modelled (``Unsupported``): base offset != 0, the absolute LBO mode (sm_103a),
    128B swizzling with 32B atomicity (the only form of transposed tf32), sub-byte elements. kcols must be the
    instruction's K: 32 bytes of elements (Table 39: K = 16 f16/bf16, 8 tf32, 32 f8).
    """
    d = umma_smem_desc_decode(desc)
    if elem_bits not in (8, 16, 32):
        raise Unsupported(f"tcgen05.mma operand of {elem_bits}-bit elements in shared memory")
    eb = elem_bits // 8
    if kcols * eb != 32:
        raise Unsupported(f"tcgen05.mma operand K = {kcols} x {elem_bits}-bit: the dense K extent is 32 bytes")
    if rows % 8:
        raise Unsupported(f"tcgen05.mma operand with {rows} rows (must be a multiple of 8)")
    if d.base_offset != 0:
        raise Unsupported(f"tcgen05 shared memory descriptor base offset {d.base_offset} (only 0 is modelled)")
    if d.lbo_mode:
        raise Unsupported("tcgen05 shared memory descriptor with the absolute leading-dimension mode (sm_103a)")
    if d.swizzle < 0:
        raise Unsupported("tcgen05 shared memory descriptor swizzling mode 128B with 32B atomicity")
    if not k_major and elem_bits == 32:
        raise Unsupported(
            "transposed (MN-major) tf32 tcgen05.mma operand: valid only with 128B/32B-atomic swizzle (Table 54)")
    r = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(kcols, dtype=np.int64)[None, :]
    W = d.swizzle
    if k_major:
        kb = k * eb
        if W == 0:
            off = (r % 8) * 16 + (r // 8) * d.sbo + kb % 16 + (kb // 16) * d.lbo
        else:
            off = (r % 8) * W + (r // 8) * d.sbo + kb
    else:
        mb = r * eb
        if W == 0:
            off = mb % 16 + (mb // 16) * d.sbo + (k % 8) * 16 + (k // 8) * d.lbo
        else:
            off = mb % W + (mb // W) * d.lbo + (k % 8) * W + (k // 8) * d.sbo
    return swizzle_addr(d.start_addr + off, W).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class UmmaInstrDesc:
    sparse_sel: int
    sparse: int
    saturate: int
    dtype: int
    atype: int
    btype: int
    neg_a: int
    neg_b: int
    trans_a: int
    trans_b: int
    n: int
    m: int
    max_shift: int
    reserved: int  # bits 6, 23, 29 (must be 0)


def umma_instr_desc_decode(idesc: int) -> UmmaInstrDesc:
    """The 32-bit tcgen05.mma instruction descriptor for .kind::tf32/f16/f8f6f4/i8, PTX ISA 9.1 9.7.16.4.2
    "Instruction descriptor" (Table 42):
      0-1 sparsity selector, 2 sparsity, 3 saturate, 4-5 dtype (F16 0, F32 1, S32 2), 6 reserved,
      7-9 atype, 10-12 btype (f16 kind: F16 0, BF16 1; tf32: TF32 2; f8f6f4: E4M3 0, E5M2 1, E2M3 3, E3M2 4,
      E2M1 5), 13 negate A, 14 negate B, 15 transpose A, 16 transpose B, 17-22 N >> 3, 23 reserved,
      24-28 M >> 4, 29 reserved, 30-31 maximum shift (.ws only).
    Same bitfields as CUTLASS ``cute::UMMA::InstrDescriptor`` (cute/arch/mma_sm100_desc.hpp)."""
    i = int(idesc) & 0xFFFFFFFF
    return UmmaInstrDesc(
        sparse_sel=i & 3, sparse=(i >> 2) & 1, saturate=(i >> 3) & 1, dtype=(i >> 4) & 3,
        atype=(i >> 7) & 7, btype=(i >> 10) & 7, neg_a=(i >> 13) & 1, neg_b=(i >> 14) & 1,
        trans_a=(i >> 15) & 1, trans_b=(i >> 16) & 1, n=((i >> 17) & 0x3F) << 3, m=((i >> 24) & 0x1F) << 4,
        max_shift=(i >> 30) & 3, reserved=((i >> 6) & 1) | (((i >> 23) & 1) << 1) | (((i >> 29) & 1) << 2))


def umma_instr_desc_encode(m: int, n: int, dtype: int, atype: int, btype: int, trans_a: int = 0, trans_b: int = 0,
                           neg_a: int = 0, neg_b: int = 0) -> int:
    """Inverse of ``umma_instr_desc_decode`` for dense descriptors (CUTLASS ``make_instr_desc``)."""
    return ((dtype << 4) | (atype << 7) | (btype << 10) | (neg_a << 13) | (neg_b << 14) | (trans_a << 15)
            | (trans_b << 16) | ((n >> 3) << 17) | ((m >> 4) << 24))


def tmem_ld_st_map(shape: str, num: int, warp_in_wg: int, taddr: int) -> tuple[np.ndarray, np.ndarray]:
    """(lane, column) of Tensor Memory that each (thread, register) of a ``tcgen05.ld`` / ``tcgen05.st`` accesses:
    two int64 arrays of shape (32 threads, nregs). PTX ISA 9.1 9.7.16.2.3.1.1 "Matrix fragments for shape .32x32b"
    (Figure 183): a warp accesses 32 TMEM lanes, thread t lane ``taddr.lane + t``, and each lane (32 * .num) bits:
    register r holds column ``taddr.column + r``. 9.7.16.8.1 "Access restrictions": warp w of its warpgroup may
    access lanes 32*(w%4) .. 32*(w%4)+31 only; an access outside them raises ``MemoryFault``.

    The .16x64b/.16x128b/.16x256b/.16x32bx2 shapes are defined by figures (184-187) we could not read: they raise
    ``Unsupported`` rather than guess."""
    lane0, col0 = (taddr >> 16) & 0xFFFF, taddr & 0xFFFF
    if shape != "32x32b":
        raise Unsupported(f"tcgen05.ld/st shape .{shape} (only .32x32b is modelled)")
    lo = 32 * (warp_in_wg % 4)
    if lane0 != lo:
        raise MemoryFault(f"tcgen05.ld/st .32x32b by warp {warp_in_wg % 4} of its warpgroup at TMEM lane {lane0}: "
                          f"that warp may access lanes {lo}-{lo + 31} only (PTX ISA 9.7.16.8.1)")
    t = np.arange(32, dtype=np.int64)[:, None]
    r = np.arange(num, dtype=np.int64)[None, :]
    return np.broadcast_to(lane0 + t, (32, num)).copy(), np.broadcast_to(col0 + r, (32, num)).copy()


# ----------------------------------------------------------------------------------------------------------------
# TMA .tile::gather4 (sm_100a)
# ----------------------------------------------------------------------------------------------------------------

def tma_gather4_addrs(tmap: TensorMap, col: int, rows: tuple, smem_dst: int):
    """Element maps of one ``cp.async.bulk.tensor.2d...tile::gather4`` load (PTX ISA 5.5.3.4 ".tile::scatter4 and
    .tile::gather4 modes", 9.7.9.27.1.2 cp.async.bulk.tensor: coordinates ``{col_idx, row_idx0..row_idx3}``).

    Four bounding boxes of one row each (5.5.3.4.1: the box's dimension-1 size in the tensor map must be one), all
    starting at column ``col``, rows ``rows[0..3]``, are combined into one 2-D destination of 4 rows x box[0]
    elements: element (i, j) (i < 4, j < box[0]) has tensor coordinate (col + j, rows[i]);
      gaddr    = tmap.address + (col + j) * strides[0] + rows[i] * strides[1]   (meaningful only where in_bounds)
      in_bounds = 0 <= col + j < dims[0] and 0 <= rows[i] < dims[1]   (5.5.3.3: out-of-bound elements are filled)
      saddr    = swizzle_addr(smem_dst + elem_bytes * (i * box[0] + j), tmap.swizzle)  (rows stacked, dense)
    The swizzle is on absolute shared address bits: a destination off the pattern's repeat boundary starts at the
    non-zero base offset of 5.5.7 ((dst / 128) % 8 for 128B), which is what the absolute-address XOR gives; the
    destination must be 128-byte aligned. "All other constraints and rules of the tile mode apply" (5.5.3.4): inner
    box bytes a multiple of 16, equal to the swizzle span when swizzled (as ``tma_box_addrs``).
    Returns (gaddr int64 (n,), in_bounds bool (n,), saddr int64 (n,)), n = 4 * box[0], row-major (i, j).
    """
    if tmap.rank != 2:
        raise MemoryFault(f"tile::gather4 on a rank-{tmap.rank} tensor map (PTX ISA 5.5.3.4: 2-D tensors only)")
    if len(rows) != 4:
        raise Unsupported(f"tile::gather4 with {len(rows)} row coordinates (4 expected)")
    if tmap.interleave:
        raise MemoryFault("tile::gather4 with an interleaved tensor map (PTX ISA 5.5.3.4: not supported)")
    if tmap.box[1] != 1:
        raise MemoryFault(f"tile::gather4 tensor map box {tmap.box}: the bounding box's dimension-1 size must be one "
                          f"(PTX ISA 5.5.3.4.1)")
    if tmap.elem_bytes < 1:
        raise Unsupported(f"TMA of sub-byte type {tmap.dtype}")
    if tuple(tmap.elem_strides) != (1, 1):
        raise Unsupported(f"tile::gather4 with traversal strides {tmap.elem_strides}")
    eb, width, sw = tmap.elem_bytes, int(tmap.box[0]), tmap.swizzle
    inner = width * eb
    if inner % 16:
        raise MemoryFault(f"TMA box inner dimension {width} x {eb} B = {inner} B is not a multiple of 16 bytes "
                          "(PTX ISA 5.5 bounding box; cuTensorMapEncodeTiled)")
    if sw not in _SWIZZLE_BITS:
        raise Unsupported(f"TMA swizzle {sw}")
    if sw and inner > sw:
        raise MemoryFault(f"TMA box inner dimension {inner} B exceeds the {sw}B swizzle span (PTX ISA 5.5.7)")
    if sw and inner < sw:
        raise Unsupported(f"TMA box inner dimension {inner} B below the {sw}B swizzle span (short swizzled rows "
                          f"not modelled)")
    if smem_dst % 128:
        raise MemoryFault(f"cp.async.bulk.tensor shared address {smem_dst:#x} not 128-byte aligned")
    i = np.repeat(np.arange(4, dtype=np.int64), width)
    j = np.tile(np.arange(width, dtype=np.int64), 4)
    c0 = int(col) + j
    c1 = np.asarray([int(r) for r in rows], np.int64)[i]
    gaddr = int(tmap.address) + c0 * int(tmap.strides[0]) + c1 * int(tmap.strides[1])
    inb = (c0 >= 0) & (c0 < int(tmap.dims[0])) & (c1 >= 0) & (c1 < int(tmap.dims[1]))
    saddr = swizzle_addr(int(smem_dst) + (i * width + j) * eb, sw).astype(np.int64)
    return gaddr.astype(np.int64), inb, saddr
