"""A Hugging Face Llama served from a cute-kv paged cache: continuous batching, chunked prefill, prefix caching.

The engine loop of an inference server, small: requests arrive at different steps, prompts share a system
prefix, each step batches prefill chunks with decode tokens, and every step is manager -> model (our
attention inside ``transformers``) -> commit. A tiny randomly initialised Llama (no download) keeps it fast on
a CPU; ``--check`` reruns every prompt through ``transformers``' own eager attention and compares tokens and
logits.

    python examples/transformers_llama.py [--check]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cute_kv import KVCacheParams, PagedKVCacheManager
from cute_kv.transformers_attention import ATTENTION, forward_step, register


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    # No end-of-sequence token: every request generates exactly max_new_tokens, here and in generate().
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def example_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """Prompts of different lengths behind one shared system prefix; the last repeats the first."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (21,), generator=g).tolist()
    prompts = [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 30, 1, 12)]
    return prompts + [list(prompts[0])]


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    arrival: int  # the step the request arrives at
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache


def serve(model, prompts, *, max_new_tokens: int = 32, page_size: int = 4, chunk: int = 16,
          arrival_every: int = 3):
    """Greedy-decode every prompt through one ``PagedKVCacheManager``; returns the requests and the manager."""
    register()
    model.set_attn_implementation(ATTENTION)
    cfg = model.config
    params = KVCacheParams(model.dtype, n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                           page_size=page_size, total_num_layers=cfg.num_hidden_layers, enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, total_num_pages=256)
    waiting = [Request(i, p, i * arrival_every) for i, p in enumerate(prompts)]
    running, done, step = [], [], 0
    while waiting or running:
        while waiting and waiting[0].arrival <= step:  # admit arrivals
            req = waiting.pop(0)
            mgr.claim(req.rid)
            running.append(req)
        batch, ids = [], []
        for req in running:
            if req.prefilled < len(req.prompt):  # a prefill chunk, after the prompt's cached prefix
                rest = req.prompt[req.prefilled:]
                ids.append(rest[:mgr.lookup_prefix(req.rid, rest) + chunk])
            else:  # decode: the last sampled token
                ids.append(req.generated[-1:])
            batch.append(req)
        if not batch:
            step += 1
            continue
        rids = [r.rid for r in batch]
        if not mgr.can_allocate(rids, token_ids=ids):
            raise RuntimeError("the page pool is too small for this example's batch")
        inputs = mgr.allocate(rids, token_ids=ids)  # manager
        rows = [x[len(x) - n:] for x, n in zip(ids, inputs.new_token_counts)]  # prefix hits are not run
        logits = forward_step(model, inputs, torch.tensor([t for r in rows for t in r]))  # model -> ops
        mgr.commit()  # the step's K/V is in the cache
        for b, (req, x) in enumerate(zip(batch, ids)):
            if req.prefilled < len(req.prompt):
                req.prefilled += len(x)
                if req.prefilled < len(req.prompt):
                    continue  # mid-prompt: these logits predict a prompt token
            req.logits.append(logits[b])
            req.generated.append(int(logits[b].argmax()))
            if len(req.generated) == max_new_tokens:
                mgr.release(req.rid)
                running.remove(req)
                done.append(req)
        step += 1
    return sorted(done, key=lambda r: r.rid), mgr


def eager_reference(model, prompt: list[int], max_new_tokens: int = 32):
    """``transformers``' own greedy generation with its eager attention: ``(tokens, logits per token)``."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with transformers' eager attention")
    args = ap.parse_args(argv)
    model = tiny_llama()
    prompts = example_prompts(model.config.vocab_size)
    requests, mgr = serve(model, prompts)
    for req in requests:
        print(f"request {req.rid}: prompt {len(req.prompt)} tokens -> {req.generated[:8]}...")
    print(mgr.metrics)
    if not args.check:
        return 0
    worst, same = 0.0, True
    for req in requests:
        tokens, logits = eager_reference(model, req.prompt, len(req.generated))
        same &= tokens == req.generated
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(req.logits, logits)))
    print(f"vs transformers eager attention: tokens {'identical' if same else 'DIFFER'}, "
          f"max |logit difference| {worst:.2e}")
    return 0 if same and worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
