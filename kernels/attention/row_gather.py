"""K/V rows of a key tile gathered one token at a time by ``cp.async`` (the SM90 attention's load path for pages
that no TMA box tiles: pages under 16 rows, or pages that neither divide nor are divided by the key tile).

A whole warpgroup loads: warp ``w`` owns keys ``[w * bn/4, (w+1) * bn/4)`` of the tile. Lane ``k`` of the warp
looks up key ``k``'s row once per tile (``populate.key_row``: lookup entry x page pitch + offset in the page, -1
past the keys or past the lookup table's row); each pass then moves ``32 / chunks`` rows, a row's ``chunks``
16-byte pieces by consecutive lanes (a head's row is contiguous in global memory; rows and heads are the view's
strides apart), each lane taking its row's index from the lane that looked it up (``shfl.sync``). A row of -1 (a key
past the request, a page column past the table's row, a lookup entry naming no page, as only unchecked metadata
holds) is zero-filled: its copy reads no global memory (``cp.async``'s source size 0), so every row of the stage
holds a key's values or zeros, as a TMA box's out-of-bound rows do, never what the stage held before (or nothing
written, on the first tiles). Each thread then
arrives on the stage's full barrier with ``cp.async.mbarrier.arrive.noinc``, which fires when its copies have
landed (the barrier counts the warpgroup's 128 threads). cp.async writes through the generic proxy, so a consumer
fences (``fence.proxy.async``) between its wait and the wgmmas that read the stage.

Addresses are 64-bit (``row * H * D`` passes 2^31 elements on large caches before the row does).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from cute_kv.kernels.paged.populate import key_row

@dsl_user_op
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None):
    """``cp.async.cg.shared.global [dst], [src], 16, src_bytes``: 16 bytes into shared memory, the first
    ``src_bytes`` read from global memory and the rest zeros (PTX ISA 9.7.9.25.3: ``src-size``); L2 only, each row
    is read once per tile."""
    args = [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


WARPS = 4  # the loading warpgroup
CHUNK_BYTES = 16  # one cp.async
SWIZZLE_BYTES = 128  # the stage's swizzle: rows of 128 bytes, 16-byte pieces xor the row's index mod 8
SWIZZLE_ROWS = 8


class RowGather:
    """One key tile of ``bn`` rows x ``head_dim`` elements of ``dtype``, from a ``[rows, H, D]`` row view into a
    ``(bn, head_dim)`` shared-memory stage in the K-major 128-byte swizzle the wgmmas read
    (``tma_tiles.smem_tile_layout``: 8-row atoms of 128 bytes stacked along the rows, then along the head dim).

    Lane ``l`` copies piece ``l % chunks`` of rows ``r0 + j`` (``j < passes``), ``r0 = warp * bn/4 + (l // chunks) *
    passes``, a multiple of 8: row ``r0 + j``'s swizzle is ``j % 8`` whatever the lane, so each copy's shared address
    is the pass-0 address xor a constant plus a constant (nothing per pass kept in registers), and its row comes from
    lane ``(l // chunks) * passes + j`` by a shuffle segmented at ``chunks`` lanes with the constant index ``j``."""

    def __init__(self, bn: int, head_dim: int, page_size: int, dtype, swizzle_bytes: int):
        self.bn, self.head_dim, self.page_size, self.dtype = bn, head_dim, page_size, dtype
        self.vec = CHUNK_BYTES * 8 // dtype.width  # elements per copy
        self.chunks = head_dim // self.vec  # copies per row
        self.rows_per_warp = bn // WARPS
        self.passes = self.rows_per_warp * self.chunks // 32  # copies per thread per tile
        groups = 32 // self.chunks if self.chunks <= 32 else 0  # rows a pass of a warp moves
        if (swizzle_bytes != SWIZZLE_BYTES or not groups or self.rows_per_warp > 32 or self.passes % SWIZZLE_ROWS
                or (groups > 1 and self.passes != self.chunks)):
            raise ValueError(f"no gather plan for a {bn} x {head_dim} tile in a {swizzle_bytes}-byte swizzle")
        self.segment = self.chunks if groups > 1 else 32  # lanes that share their rows' lookups


    @cute.jit
    def lane_row(self, lookup_table: cute.Tensor, batch_idx: Int32, tile_base: Int32, warp: Int32, lane: Int32,
                 num_keys: Int32, rows_per_page: Int32, num_rows: Int32) -> Int32:
        """The row of key ``tile_base + warp * bn/4 + lane`` (lanes past the warp's keys look up the next warp's:
        never read), or -1 (zero-filled, nothing read): a key past ``num_keys``, a page column past the table's row,
        or a row outside the view's ``num_rows`` (a lookup entry that names no page, as unchecked metadata may
        hold: reading it would leave the cache)."""
        row = key_row(lookup_table, batch_idx, tile_base + warp * self.rows_per_warp + lane, num_keys,
                      rows_per_page, self.page_size, Int32(-1))
        if Uint32(row) >= Uint32(num_rows):
            row = Int32(-1)
        return row

    def stage_offset(self, warp: Int32, lane: Int32) -> Int32:
        """Bytes from the stage's start to the lane's piece of pass 0: its row ``r0`` (a multiple of 8, so unswizzled)
        in its column of swizzle atoms."""
        chunk = lane % self.chunks
        atom_cols = SWIZZLE_BYTES // CHUNK_BYTES  # pieces per swizzle row
        r0 = warp * self.rows_per_warp + lane // self.chunks * self.passes
        return chunk // atom_cols * self.bn * SWIZZLE_BYTES + r0 * SWIZZLE_BYTES + chunk % atom_cols * CHUNK_BYTES

    def pass_address(self, address: Int32, j: int) -> Int32:
        """The lane's piece of pass ``j`` from that of pass 0: row ``r0 + j``, its piece xor ``j % 8``."""
        return (address ^ j % SWIZZLE_ROWS * CHUNK_BYTES) + j * SWIZZLE_BYTES

    def source_lane(self, lane: int, j: int) -> int:
        """The lane whose lookup the segmented shuffle of pass ``j`` reads: row ``r0 + j``'s."""
        return lane // self.segment * self.segment + j

    def source(self, g_rows: cute.Tensor, head: Int32, lane: Int32):
        """``(address of the lane's piece of row 0 of head ``head``, bytes from one row to the next)`` in the row
        view ``[rows, H, D]``: its own strides (``H*D``, ``D`` in MAX's compact cache, compile-time there; an
        engine's strided plane's at run time)."""
        width = self.dtype.width // 8
        row_stride, head_stride = g_rows.stride[0], g_rows.stride[1]
        return (g_rows.iterator.toint() + (head * head_stride + lane % self.chunks * self.vec) * width,
                row_stride * width)

    @cute.jit
    def copy_tile(self, g_rows: cute.Tensor, stage: cute.Tensor, row: Int32, head: Int32, warp: Int32,
                  lane: Int32):
        """Issue the warp's rows of the tile into ``stage`` (1024-byte aligned), ``row`` from ``lane_row``; the
        pipeline's commit (``PipelineCpAsync``: a noinc arrival) follows."""
        src0, row_bytes = self.source(g_rows, head, lane)
        dst0 = stage.iterator.toint() + self.stage_offset(warp, lane)
        for j in cutlass.range_constexpr(self.passes):
            src_row = cute.arch.shuffle_sync(row, j, mask_and_clamp=(32 - self.segment) << 8 | 31)
            present = src_row >= 0
            # a missing row copies 0 of the 16 bytes from row 0's address (read nothing, fill zeros)
            src = src0 + Int64(cutlass.max(src_row, Int32(0))) * row_bytes
            cp_async_16(self.pass_address(dst0, j), src, cutlass.select_(present, Int32(CHUNK_BYTES), Int32(0)))
