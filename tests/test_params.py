import math

import pytest
import torch

from cute_kv import KVCacheParams, KVCacheQuantizationConfig, KVCacheStrategy


def llama(**kw):
    base = dict(dtype=torch.bfloat16, n_kv_heads=8, head_dim=128, page_size=16, total_num_layers=32)
    base.update(kw)
    return KVCacheParams(**base)


def test_strategy_names():
    assert KVCacheStrategy.PAGED.kernel_substring() == "paged"
    assert KVCacheStrategy("model_default") is KVCacheStrategy.MODEL_DEFAULT
    assert KVCacheStrategy.PAGED.uses_opaque()


def test_llama_shapes_and_bytes():
    p = llama()
    assert p.shape_per_block == [2, 32, 16, 8, 128]
    assert p.static_cache_shape == ("num_layers", "batch_size", "seq_len", "n_kv_heads", "head_dim")
    assert p.dtype_shorthand == "bf16"
    # 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token
    assert p.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert p.bytes_per_block == p.bytes_per_token * 16
    assert p.total_num_pages(10 * p.bytes_per_block + 5) == 10
    with pytest.raises(ValueError, match="available_cache_memory"):
        p.total_num_pages(p.bytes_per_block - 1)


def test_tensor_parallel_heads():
    p = llama(n_devices=4)
    assert p.n_kv_heads_per_device == 2
    assert p.shape_per_block[3] == 2
    # bytes_per_block sums the shards, so the per-token figure does not depend on the split
    assert p.bytes_per_block == llama().bytes_per_block
    with pytest.raises(ValueError, match="n_kv_heads"):
        llama(n_devices=3)
    with pytest.raises(ValueError, match="n_kv_heads_per_device"):
        llama(n_devices=4, n_kv_heads_per_device=3)


def test_mla_is_replicated_and_single_plane():
    p = llama(n_kv_heads=1, head_dim=576, is_mla=True, n_devices=8)
    assert p.kv_dim == 1 and p.n_kv_heads_per_device == 1
    assert p.shape_per_block == [1, 32, 16, 1, 576]
    with pytest.raises(ValueError, match="n_kv_heads must be 1"):
        llama(is_mla=True)


@pytest.mark.parametrize("total,pp", [(32, 4), (30, 4), (5, 5), (7, 2)])
def test_pipeline_split_covers_every_layer_once(total, pp):
    ranges = [llama(total_num_layers=total, pipeline_parallel_degree=pp, stage_id=s).stage_layer_range(s)
              for s in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1
    p = llama(total_num_layers=total, pipeline_parallel_degree=pp, stage_id=pp - 1)
    assert p.num_layers == sizes[-1] == p.shape_per_block[1]
    assert p.for_stage(0).num_layers == sizes[0]


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(dtype=torch.int8), "dtype"),
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(head_dim=-1), "head_dim"),
        (dict(page_size=None), "page_size"),
        (dict(page_size=0), "page_size"),
        (dict(cache_strategy="bogus"), "cache_strategy"),
        (dict(enable_prefix_caching=True, cache_strategy="model_default"), "enable_prefix_caching"),
        (dict(enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=1.0), "enable_prefix_caching"),
        (dict(enable_kvcache_swapping_to_host=True, enable_prefix_caching=True), "host_kvcache_swap_space_gb"),
        (dict(pipeline_parallel_degree=2, stage_id=None), "stage_id"),
        (dict(pipeline_parallel_degree=2, stage_id=2), "stage_id"),
        (dict(pipeline_parallel_degree=2, stage_id=0, total_num_layers=None), "total_num_layers"),
        (dict(pipeline_parallel_degree=40, stage_id=0), "total_num_layers"),
        (dict(pipeline_parallel_degree=2, stage_id=0, n_layers_per_stage=3), "n_layers_per_stage"),
        (dict(kvcache_quant_config=KVCacheQuantizationConfig()), "kvcache_quant_config"),
        (dict(dtype=torch.float8_e4m3fn, head_dim=96, kvcache_quant_config=KVCacheQuantizationConfig()),
         "quantization_granularity"),
    ],
)
def test_invalid_combinations_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        llama(**kw)


def test_quant_config_validation():
    with pytest.raises(ValueError, match="scale_dtype"):
        KVCacheQuantizationConfig(scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantization_granularity"):
        KVCacheQuantizationConfig(quantization_granularity=0)


def test_fp8_scales_shape_and_bytes():
    q = KVCacheQuantizationConfig(scale_dtype=torch.float32, quantization_granularity=64)
    p = llama(dtype=torch.float8_e4m3fn, kvcache_quant_config=q)
    assert p.dtype_shorthand == "f8_m4e3fn"
    assert p.quantized_kv_cache and p.head_dim_granularity == 2
    assert p.shape_per_scale_block == [2, 32, 16, 8, 2]
    data = math.prod(p.shape_per_block)
    scales = math.prod(p.shape_per_scale_block) * 4
    assert p.bytes_per_block == data + scales


def test_continuous_is_deprecated():
    with pytest.warns(DeprecationWarning):
        llama(cache_strategy=KVCacheStrategy.CONTINUOUS)


def test_host_swap_pages():
    p = llama(enable_prefix_caching=True, enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=0.5)
    assert p.total_num_host_pages() == int(0.5 * 2**30) // p.bytes_per_block
    assert llama().total_num_host_pages() == 0
