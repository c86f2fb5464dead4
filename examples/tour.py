import torch, cute_kv
from cute_kv import KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheCollection
from cute_kv.manager import PagedKVCacheManager

device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the PyTorch reference of every op
torch.manual_seed(0)

# What the cache holds (MAX's KVCacheParams; invalid combinations raise ValueError naming the field).
# Llama-3-8B attention (32 query / 8 KV heads of 128), 4 of its 32 layers to keep the tour small.
params = KVCacheParams(torch.bfloat16, n_kv_heads=8, head_dim=128, page_size=16, total_num_layers=4)
print(params.shape_per_block, params.bytes_per_token, params.bytes_per_block)  # [KVD=2, L, P, H, D], bytes
fp8 = KVCacheParams(torch.float8_e4m3fn, 8, 128, page_size=16, total_num_layers=4,  # FP8, one float32 scale
                    kvcache_quant_config=KVCacheQuantizationConfig(torch.float32, 128))  # per (token, head, 128)
print(fp8.shape_per_scale_block)  # [KVD, L, P, H, ceil(D / 128)]

# The block manager: owns pages (plus a null page), builds each step's lookup table, reuses prefixes
mgr = PagedKVCacheManager(params, total_num_pages=64, devices=[device])
mgr.claim("req-0"); mgr.claim("req-1")                    # prefix_keys=PrefixKeys(lora_id=, tenant_salt=, multimodal=)
step = mgr.allocate(["req-0", "req-1"], [37, 1])          # or token_ids=... for prefix caching; num_steps=k reserves
coll, ro = step.collections[0], step.input_row_offsets[0]  # PagedKVCacheCollection, uint32 [B+1] (int32 works too)
pos, last = step.positions[0], step.last_row_indices[0]    # int64 RoPE positions [T], logits rows [B]
# also: can_allocate(...), lookup_prefix(rid, ids), fork(parent, child), rollback(rid, n),
# allocate(..., graph_buffers=GraphStepBuffers(mgr, max_batch, max_context, max_tokens)) for CUDA graphs
T, Hq, H, D = 38, 32, 8, 128

# Ops: torch tensors in, validated before anything is written. On CUDA a call no kernel serves runs the reference
# and warns once per reason (CUTE_KV_STRICT=1 makes it an error); cute_kv.explain says which path a call takes.
# validate=False skips the checks that read device values, for CUDA-graph capture.
hidden = torch.randn(T, 1024, device=device, dtype=torch.bfloat16)
w_qkv = torch.randn(Hq * D + 2 * H * D, 1024, device=device, dtype=torch.bfloat16) / 32
rope = cute_kv.RopeConfig.from_theta(D, 8192, 500000.0, device=device)
q = cute_kv.fused_qkv_matmul_kv_cache(hidden, ro, w_qkv, coll, 0, rope=rope)  # Q returned, K/V into layer 0's pages
#   qk_norm=cute_kv.QKNorm(q_gamma, k_gamma) (Qwen3/Gemma per-head RMSNorm before RoPE; MLA: k_gamma of kv_lora_rank)
#   weights: a [N, K] tensor, cute_kv.Int4Weight(packed_u8[N, K/2], scales[N, K/g], g, has_zp, zero_points) (low
#   nibble = even k; w = (q - z) * s, z = 8 without zero points) or cute_kv.Fp8Weight(e4m3[N, K], scales_f32[N])
o = cute_kv.paged_attention(q.view(T, Hq, D), ro, coll, 0, causal=True, window=None)  # [T, Hq, D]
k, v = (torch.randn(T, H, D, device=device, dtype=torch.bfloat16) for _ in range(2))
cute_kv.store_kv(k, v, ro, coll, layer_idx=1)                  # token i of request b at cache_lengths[b] + i
print(cute_kv.explain(cute_kv.paged_attention, q.view(T, Hq, D), ro, coll, 0, arch="sm_90a"))

# The cache model, MAX's PagedKVCacheCollection / PagedKVCache in Python spelling
print(coll.blocks.shape)       # [N, KVD, L, P, H, D] row-major; coll.scales [N, KVD, L, P, H, ceil(D/gran)] or None
k1 = coll.get_key_cache(1)     # PagedKVCache: 4-D view [N, P, H, D], stride[0] = full page pitch KVD*L*P*H*D
b, t = 0, 20
assert k1.row_idx(b, t) == int(coll.lookup_table[b, t // 16]) * (2 * 4 * 16) + t % 16  # LUT[b, t//P]*KVD*L*P + t%P
assert torch.equal(k1.row_view()[k1.row_idx(b, t)], k[t])     # the rows TMA descriptors address
rows = k1.populate(bn=64, base_alignment=64, batch_idx=b, base_kv_row=0)  # PagedRowIndices (MAX's chunked LUT load)
print(rows, k1.num_kv_rows(), k1.block_paged_ptr(16, b, 16, 3))
assert torch.equal(k1.load(b, 3, t, 0, width=D), k[t, 3])     # element access; store(...) writes

mgr.commit()                   # the step's K/V is in the cache; its collections are now stale (refused)
mgr.release("req-1")
