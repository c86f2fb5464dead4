"""MAX's per-tensor rope-aware FP8 MLA row: ``[padded_depth e4m3 content bytes | rope_dim bf16 rope values]``.

A row of the cache is ``head_size = padded_depth + 2*rope_dim`` bytes (DeepSeek: 512 + 2*64 = 640) with one
float32 scale per token (the scale index is the row index of the per-layer row view). The logical row, what
attention sees and what ``store_kv`` takes, has ``latent_dim = padded_depth + rope_dim`` values (576):
``concat(content * scale, rope)``. Storing quantizes the content per token exactly as ``reference/quant.py``
(``quantize_fp8`` over one granule of ``padded_depth``) and rounds the rope part to bf16 (little endian bytes).
Host code only (torch); kernels address the same bytes through ``cute_kv.layouts.rope_aware``.
"""

from __future__ import annotations

import dataclasses

import torch

ROPE_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class RopeAwareRow:
    """Byte geometry of one row: content bytes ``[0, padded_depth)``, rope bytes ``[padded_depth, row_bytes)``."""

    padded_depth: int
    rope_dim: int

    @property
    def row_bytes(self) -> int:
        return self.padded_depth + 2 * self.rope_dim

    @property
    def latent_dim(self) -> int:
        return self.padded_depth + self.rope_dim

    @property
    def rope_offset(self) -> int:
        """Byte offset of the rope tail in a row (``padded_depth``); in bf16 elements ``padded_depth // 2``."""
        return self.padded_depth

    def content(self, rows: torch.Tensor) -> torch.Tensor:
        """The e4m3 content of ``rows [..., row_bytes]`` (fp8 or uint8): ``[..., padded_depth]`` float8_e4m3fn."""
        return _bytes(rows)[..., : self.padded_depth].view(torch.float8_e4m3fn)

    def rope(self, rows: torch.Tensor) -> torch.Tensor:
        """The bf16 rope tail of ``rows [..., row_bytes]``: ``[..., rope_dim]`` bfloat16 (a copy when the bytes are
        not 2-byte aligned in memory)."""
        tail = _bytes(rows)[..., self.padded_depth:]
        return tail.contiguous().view(ROPE_DTYPE)

    def decode(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Dequantized logical rows float32 ``[..., latent_dim]`` of ``rows [..., row_bytes]`` and their per-token
        ``scales [..., 1]``."""
        content = self.content(rows).to(torch.float32) * scales.to(torch.float32)
        return torch.cat([content, self.rope(rows).to(torch.float32)], dim=-1)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical rows ``x [..., latent_dim]`` (any float dtype; the float32 accumulator, not a bf16 rounding) ->
        ``(rows float8_e4m3fn [..., row_bytes], scales float32 [..., 1])``."""
        from cute_kv.reference.quant import quantize_fp8

        if x.shape[-1] != self.latent_dim:
            raise ValueError(f"rope-aware rows take {self.latent_dim} values (padded_depth {self.padded_depth} + "
                             f"rope_dim {self.rope_dim}), got {x.shape[-1]}")
        content, scales = quantize_fp8(x[..., : self.padded_depth], self.padded_depth, torch.float32)
        rope = x[..., self.padded_depth:].to(ROPE_DTYPE).contiguous().view(torch.uint8)
        rows = torch.cat([content.view(torch.uint8), rope], dim=-1)
        return rows.view(torch.float8_e4m3fn), scales


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)
