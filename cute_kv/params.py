"""KV cache parameters: MAX's ``KVCacheParams`` / ``KVCacheStrategy`` in Python spelling.

Describes *what* a cache holds (dtype, heads, head dim, page size, layers, devices, quantization);
``PagedKVCacheCollection`` holds the tensors. Invalid combinations raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import Optional

import torch

from cute_kv.dtypes import DTYPE_SHORTHAND, KV_DTYPES, SCALE_DTYPES, dtype_name, is_fp8


class KVCacheStrategy(str, enum.Enum):
    MODEL_DEFAULT = "model_default"
    PAGED = "paged"
    CONTINUOUS = "continuous"  # deprecated in MAX: use PAGED

    def kernel_substring(self) -> str:
        """The substring MAX puts in kernel/op names for this strategy (e.g. ``paged``)."""
        return self.value

    def uses_opaque(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class KVCacheQuantizationConfig:
    """FP8 KV quantization: one scale per (token, head, granule of ``quantization_granularity`` dims).

    ``rope_dim`` (MAX's per-tensor rope-aware MLA layout): each row holds ``head_dim - 2*rope_dim`` e4m3 content
    bytes, then ``rope_dim`` bfloat16 rope values; one float32 scale per token covers the content only
    (``quantization_granularity == head_dim``). None: an ordinary quantized cache.
    """

    scale_dtype: torch.dtype = torch.float32
    quantization_granularity: int = 128
    rope_dim: Optional[int] = None

    def __post_init__(self):
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype must be one of {sorted(dtype_name(d) for d in SCALE_DTYPES)}, "
                f"got {self.scale_dtype}"
            )
        if not isinstance(self.quantization_granularity, int) or self.quantization_granularity <= 0:
            raise ValueError(
                f"quantization_granularity must be a positive int, got {self.quantization_granularity!r}"
            )
        r = self.rope_dim
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r <= 0):
            raise ValueError(f"rope_dim must be a positive int (bf16 rope values per row) or None, got {r!r}")


@dataclasses.dataclass
class KVCacheParams:
    """Static description of a KV cache (seed signature plus MAX's newer ``is_mla`` and quantization).

    ``n_kv_heads`` counts all devices; ``n_kv_heads_per_device`` is derived (tensor parallel split,
    replicated for MLA). With ``pipeline_parallel_degree > 1`` each stage owns a contiguous run of
    ``n_layers_per_stage`` layers (the earlier stages take one extra when the split is uneven), and the
    6-D blocks tensor of that stage has ``L = n_layers_per_stage``.
    """

    dtype: torch.dtype
    n_kv_heads: int
    head_dim: int
    enable_prefix_caching: bool = False
    enable_kvcache_swapping_to_host: bool = False
    host_kvcache_swap_space_gb: Optional[float] = None
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    page_size: Optional[int] = 128
    n_devices: int = 1
    pipeline_parallel_degree: int = 1
    stage_id: Optional[int] = None
    total_num_layers: Optional[int] = None
    n_kv_heads_per_device: int = 0
    n_layers_per_stage: Optional[int] = None
    is_mla: bool = False
    kvcache_quant_config: Optional[KVCacheQuantizationConfig] = None

    def __post_init__(self):
        self.cache_strategy = _field_enum(self.cache_strategy)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SHORTHAND.values())} (torch dtypes), got {self.dtype}")
        _positive_int("n_kv_heads", self.n_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("n_devices", self.n_devices)
        _positive_int("pipeline_parallel_degree", self.pipeline_parallel_degree)
        if self.cache_strategy is KVCacheStrategy.CONTINUOUS:
            warnings.warn("KVCacheStrategy.CONTINUOUS is deprecated; use PAGED", DeprecationWarning, stacklevel=3)
        if self.cache_strategy is KVCacheStrategy.PAGED:
            if self.page_size is None:
                raise ValueError("page_size is required with cache_strategy=PAGED")
            _positive_int("page_size", self.page_size)
        if self.enable_prefix_caching and self.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError("enable_prefix_caching requires cache_strategy=PAGED")
        if self.enable_kvcache_swapping_to_host:
            if self.cache_strategy is not KVCacheStrategy.PAGED:
                raise ValueError("enable_kvcache_swapping_to_host requires cache_strategy=PAGED")
            if not self.enable_prefix_caching:
                raise ValueError("enable_kvcache_swapping_to_host requires enable_prefix_caching=True")
            if self.host_kvcache_swap_space_gb is None or self.host_kvcache_swap_space_gb <= 0:
                raise ValueError("host_kvcache_swap_space_gb must be > 0 when enable_kvcache_swapping_to_host")
        # Heads per device: MLA's single latent head is replicated across tensor-parallel ranks.
        if self.is_mla:
            if self.n_kv_heads != 1:
                raise ValueError(f"n_kv_heads must be 1 for an MLA cache, got {self.n_kv_heads}")
            derived = 1
        else:
            if self.n_kv_heads % self.n_devices:
                raise ValueError(
                    f"n_kv_heads ({self.n_kv_heads}) must be divisible by n_devices ({self.n_devices})"
                )
            derived = self.n_kv_heads // self.n_devices
        if self.n_kv_heads_per_device not in (0, derived):
            raise ValueError(f"n_kv_heads_per_device={self.n_kv_heads_per_device} disagrees with the derived {derived}")
        self.n_kv_heads_per_device = derived
        self._check_pipeline()
        self._check_quantization()

    def _check_pipeline(self):
        pp = self.pipeline_parallel_degree
        if self.stage_id is None:
            if pp > 1:
                raise ValueError("stage_id is required when pipeline_parallel_degree > 1")
        elif not (isinstance(self.stage_id, int) and 0 <= self.stage_id < pp):
            raise ValueError(f"stage_id must be in [0, {pp}), got {self.stage_id!r}")
        if self.total_num_layers is None:
            if pp > 1:
                raise ValueError("total_num_layers is required when pipeline_parallel_degree > 1")
            if self.n_layers_per_stage is not None:
                _positive_int("n_layers_per_stage", self.n_layers_per_stage)
                self.total_num_layers = self.n_layers_per_stage
            return
        _positive_int("total_num_layers", self.total_num_layers)
        if self.total_num_layers < pp:
            raise ValueError(
                f"total_num_layers ({self.total_num_layers}) must be >= pipeline_parallel_degree ({pp})"
            )
        start, stop = self.stage_layer_range(self.stage_id or 0)
        if self.n_layers_per_stage not in (None, stop - start):
            raise ValueError(
                f"n_layers_per_stage={self.n_layers_per_stage} disagrees with the split of "
                f"{self.total_num_layers} layers over {pp} stages ({stop - start} for stage {self.stage_id or 0})"
            )
        self.n_layers_per_stage = stop - start

    def _check_quantization(self):
        q = self.kvcache_quant_config
        if q is None:
            return
        if not is_fp8(self.dtype):
            raise ValueError(f"kvcache_quant_config needs an fp8 dtype, got dtype={self.dtype}")
        if self.head_dim % q.quantization_granularity:
            raise ValueError(
                f"kvcache_quant_config.quantization_granularity ({q.quantization_granularity}) "
                f"must divide head_dim ({self.head_dim})"
            )
        if q.rope_dim is not None:
            check_rope_aware(self.is_mla, self.dtype, q.scale_dtype, q.quantization_granularity, self.head_dim,
                             q.rope_dim, "kvcache_quant_config.")

    # -- derived values ------------------------------------------------------------------------

    def stage_layer_range(self, stage_id: int) -> tuple[int, int]:
        """Global layer indices ``[start, stop)`` owned by pipeline stage ``stage_id``."""
        pp = self.pipeline_parallel_degree
        if not 0 <= stage_id < pp:
            raise ValueError(f"stage_id must be in [0, {pp}), got {stage_id}")
        if self.total_num_layers is None:
            raise ValueError("total_num_layers is not set")
        base, extra = divmod(self.total_num_layers, pp)
        start = stage_id * base + min(stage_id, extra)
        return start, start + base + (stage_id < extra)

    @property
    def num_layers(self) -> int:
        """Layers held by this stage's cache (the ``L`` of the 6-D blocks tensor)."""
        if self.n_layers_per_stage is None:
            raise ValueError("total_num_layers (or n_layers_per_stage) must be set to size the cache")
        return self.n_layers_per_stage

    @property
    def kv_dim(self) -> int:
        """``KVD``: 2 (K and V) or 1 (MLA, K only)."""
        return 1 if self.is_mla else 2

    @property
    def quantized_kv_cache(self) -> bool:
        return self.kvcache_quant_config is not None

    @property
    def rope_dim(self) -> Optional[int]:
        """bf16 rope values at the end of each row of a rope-aware MLA cache; None for other caches."""
        return self.kvcache_quant_config.rope_dim if self.kvcache_quant_config else None

    @property
    def padded_depth(self) -> int:
        """Content width of a row: ``head_dim - 2*rope_dim`` fp8 bytes (rope-aware), else ``head_dim``."""
        return self.head_dim - 2 * (self.rope_dim or 0)

    @property
    def latent_dim(self) -> int:
        """Logical width of a row (q's and k's last dim): ``padded_depth + rope_dim``, ``head_dim`` otherwise."""
        return self.padded_depth + (self.rope_dim or 0)

    @property
    def dtype_shorthand(self) -> str:
        return DTYPE_SHORTHAND[self.dtype]

    @property
    def static_cache_shape(self) -> tuple[str, str, str, str, str]:
        return ("num_layers", "batch_size", "seq_len", "n_kv_heads", "head_dim")

    @property
    def head_dim_granularity(self) -> int:
        """``G`` = ceil(head_dim / quantization_granularity): scales per (token, head)."""
        q = self.kvcache_quant_config
        return math.ceil(self.head_dim / q.quantization_granularity) if q else 0

    @property
    def shape_per_block(self) -> list[int]:
        return [self.kv_dim, self.num_layers, self.page_size, self.n_kv_heads_per_device, self.head_dim]

    @property
    def shape_per_scale_block(self) -> Optional[list[int]]:
        if not self.quantized_kv_cache:
            return None
        return [self.kv_dim, self.num_layers, self.page_size, self.n_kv_heads_per_device, self.head_dim_granularity]

    @property
    def tensor_parallel_degree(self) -> int:
        return 1 if self.is_mla else self.n_devices

    @property
    def bytes_per_block_per_device(self) -> int:
        """Bytes of one page (all layers of this stage, K and V, scales included) on one device."""
        n = math.prod(self.shape_per_block) * self.dtype.itemsize
        if self.quantized_kv_cache:
            n += math.prod(self.shape_per_scale_block) * self.kvcache_quant_config.scale_dtype.itemsize
        return n

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one page summed over the tensor-parallel shards (MAX's ``bytes_per_block``)."""
        return self.bytes_per_block_per_device * self.tensor_parallel_degree

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.page_size

    def total_num_pages(self, available_cache_memory: int) -> int:
        """Pages that fit in ``available_cache_memory`` bytes (summed over shards); error if none fit."""
        pages = int(available_cache_memory) // self.bytes_per_block
        if pages <= 0:
            raise ValueError(
                f"available_cache_memory={available_cache_memory} bytes holds no page "
                f"({self.bytes_per_block} bytes per page)"
            )
        return pages

    def total_num_host_pages(self) -> int:
        """Host pages for swapping: ``host_kvcache_swap_space_gb`` GiB over the page size."""
        if not self.enable_kvcache_swapping_to_host:
            return 0
        return int(self.host_kvcache_swap_space_gb * 2**30) // self.bytes_per_block

    def estimated_memory_size(self, available_cache_memory: int, max_batch_size: int, max_seq_len: int) -> int:
        rounded = -(-max_seq_len // self.page_size) * self.page_size
        return min(int(available_cache_memory), self.bytes_per_token * rounded * max_batch_size)

    def for_stage(self, stage_id: int) -> "KVCacheParams":
        """The same cache as seen by another pipeline stage."""
        return dataclasses.replace(self, stage_id=stage_id, n_layers_per_stage=None, n_kv_heads_per_device=0)


# Content bytes come in whole 64-byte granules: the fp8 content tile's 64B swizzle (and the bf16 rope tail's
# 16-byte alignment).
ROPE_AWARE_GRANULE = 64


def check_rope_aware(is_mla: bool, dtype: torch.dtype, scale_dtype: Optional[torch.dtype], granularity: Optional[int],
                     head_dim: int, rope_dim: int, prefix: str = "") -> None:
    """Raise ``ValueError`` unless a rope-aware row layout fits: an MLA cache of fp8 rows with one float32 scale per
    token, ``head_dim`` bytes = ``padded_depth`` content bytes + ``2*rope_dim`` bytes of bf16 rope, ``padded_depth``
    a positive multiple of 64."""
    where = f"{prefix}rope_dim={rope_dim}"
    if not is_mla:
        raise ValueError(f"{where} is for MLA caches only (is_mla=True, KVD=1); drop rope_dim for this cache")
    if not is_fp8(dtype):
        raise ValueError(f"{where} needs an fp8 cache (dtype=torch.float8_e4m3fn), got dtype={dtype}")
    if scale_dtype != torch.float32:
        raise ValueError(f"{where} needs float32 scales (one per token), got scale_dtype={scale_dtype}")
    if granularity != head_dim:
        raise ValueError(f"{where} needs one scale per token: quantization_granularity must equal head_dim "
                         f"({head_dim} bytes per row), got {granularity}")
    padded_depth = head_dim - 2 * rope_dim
    if padded_depth <= 0 or padded_depth % ROPE_AWARE_GRANULE:
        raise ValueError(
            f"{where}: head_dim ({head_dim}) counts bytes, padded_depth + 2*rope_dim; padded_depth = {padded_depth} "
            f"must be a positive multiple of {ROPE_AWARE_GRANULE} (DeepSeek: head_dim=640 = 512 + 2*64)")


def _field_enum(value) -> KVCacheStrategy:
    try:
        return KVCacheStrategy(value)
    except ValueError:
        raise ValueError(
            f"cache_strategy must be one of {[s.value for s in KVCacheStrategy]}, got {value!r}"
        ) from None


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
