"""The Hugging Face ``transformers`` client: the example engine loop (examples/transformers_llama.py) against
transformers' own eager attention, and RopeConfig built from a model's RoPE (plain, llama3, YaRN, LongRoPE)."""

import importlib.util
import math
import os
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from cute_kv import RopeConfig
from cute_kv.reference.rope import apply_rope

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "transformers_llama.py")


def load_example():
    spec = importlib.util.spec_from_file_location("transformers_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Tiny matmuls: one intra-op thread is 30x faster than two spinning on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_engine_loop_generates_exactly_what_transformers_generates(one_thread):
    """Greedy 32 tokens for 5 prompts (shared system prefix, one repeated), arriving at different steps,
    prefilled in chunks beside other requests' decode steps: the same tokens as transformers' eager
    attention, one request at a time, and logits within float32 rounding."""
    ex = load_example()
    model = ex.tiny_llama()
    prompts = ex.example_prompts(model.config.vocab_size)
    assert len({len(p) for p in prompts}) == 4
    requests, mgr = ex.serve(model, prompts, max_new_tokens=32)
    assert mgr.metrics.cache_hit_tokens >= 4 * 20  # every later prompt reused the system prefix's pages
    assert mgr.metrics.used_pages == 0 and mgr.metrics.num_requests == 0  # every request released
    for req in requests:
        tokens, logits = ex.eager_reference(model, req.prompt, 32)
        assert req.generated == tokens, f"request {req.rid}"
        worst = max(float((a - b).abs().max()) for a, b in zip(req.logits, logits))
        assert worst < 1e-4, f"request {req.rid}: logits differ by {worst}"


def test_adapter_rejects_a_call_without_a_step():
    ex = load_example()
    model = ex.tiny_llama()
    from cute_kv.transformers_attention import ATTENTION, register

    register()
    model.set_attn_implementation(ATTENTION)
    with pytest.raises(ValueError, match="cute_kv_step=StepInputs"):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)


def hf_config(**rope):
    return LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=16384, rope_parameters=rope)


def test_rope_from_a_models_cos_sin_rotates_bit_for_bit():
    config = hf_config(rope_type="default", rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 300, 128, generator=torch.Generator().manual_seed(3))
    cos, sin = rotary(x, torch.arange(300)[None])
    rope = RopeConfig.from_cos_sin(cos[0], sin[0])
    assert rope.rope_dim == 128 and not rope.interleaved
    q = torch.randn(1, 4, 300, 128, generator=torch.Generator().manual_seed(4))  # [B, H, T, D]
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = apply_rope(q[0].transpose(0, 1), torch.arange(300), rope).transpose(0, 1)
    assert torch.equal(got, want[0])
    # The same table from the model's frequencies (float64 angles: equal to float32 rounding).
    from_freq = RopeConfig.from_inv_freq(rotary.inv_freq, 300, attention_factor=rotary.attention_scaling)
    torch.testing.assert_close(from_freq.freqs_cis, rope.freqs_cis, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="cos and sin"):
        RopeConfig.from_cos_sin(cos[0], sin[0, :10])


SCALED = {
    "llama3": (dict(rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192), None),
    "yarn": (dict(rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096), None),
    "longrope": (dict(rope_theta=10000.0, short_factor=[1.0 + 0.01 * i for i in range(64)],
                      long_factor=[1.0 + 0.1 * i for i in range(64)], original_max_position_embeddings=4096), 16384),
}


@pytest.mark.parametrize("rope_type", sorted(SCALED))
def test_scaled_rope_matches_transformers(rope_type):
    params, seq_len = SCALED[rope_type]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config(rope_type=rope_type, **params), "cpu",
                                                      seq_len=seq_len)
    ctor = getattr(RopeConfig, rope_type)
    kw = {k: v for k, v in params.items() if k != "rope_theta"}
    rope = ctor(128, 16384, params["rope_theta"], **kw)
    # Frequencies and attention factor, read back from the table: cos(p * f) * a at p = 0 and 1.
    got_factor = float(rope.freqs_cis[0, 0])
    got_freq = torch.atan2(rope.freqs_cis[1, 1::2].double(), rope.freqs_cis[1, 0::2].double())
    assert math.isclose(got_factor, factor, rel_tol=1e-6)
    torch.testing.assert_close(got_freq, inv_freq.double(), rtol=1e-6, atol=1e-9)
    # Far positions: our float64 angles against transformers' float32 ones, to float32 angle rounding.
    p = torch.tensor([10000.0])
    want = torch.stack(((p * inv_freq.double()).cos(), (p * inv_freq.double()).sin()), -1).flatten() * factor
    torch.testing.assert_close(rope.freqs_cis[10000].double(), want, rtol=0, atol=5e-3)


def test_longrope_picks_its_factors_statically():
    params = dict(SCALED["longrope"][0])
    theta = params.pop("rope_theta")
    short = RopeConfig.longrope(128, 4096, theta, **params)
    long = RopeConfig.longrope(128, 16384, theta, **params)
    forced = RopeConfig.longrope(128, 4096, theta, use_long=True, **params)
    assert not torch.equal(short.freqs_cis[5], long.freqs_cis[5])
    # Same frequencies as the long table; only the attention factor (max_positions / original) differs.
    torch.testing.assert_close(forced.freqs_cis[5], long.freqs_cis[5] / long.freqs_cis[0, 0] * forced.freqs_cis[0, 0])
    with pytest.raises(ValueError, match="rope_dim / 2 = 32"):
        RopeConfig.longrope(64, 8192, theta, **params)
