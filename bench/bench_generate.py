"""Generator sampling throughput for the tiny model, with and without the KV cache;
with ``--vllm``, vLLM vs the torch sampler on one small HF model, and refit time.

Samples one group (``--n`` completions of a short prompt) to ``--max-new-tokens``
without stopping at EOS, so both variants produce the same number of tokens; reports
generated tokens per second (median of ``--repeats``) and the speed-up of the cache.

``--vllm`` (needs vLLM; ``bash scripts/setup.sh --vllm``): a random Llama written by
``workers.models.hf_tiny`` (``--hidden``, ``--layers``), sampled by the torch sampler
(``HFCausalLM``, KV cache) and by a vLLM engine (in-process) at batch 1 and 64, then
the weight refit through the bucketed transport (``workers.weight_transport``) timed
per MB, for the vLLM engine and for the torch generator.

    python -m bench.bench_generate [--n 8] [--max-new-tokens 56] [--threads 1]
    python -m bench.bench_generate --vllm [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.models.config import ModelSection, SamplingSection
from workers.models.decoder import sample
from workers.models.factory import build_model


def tokens_per_s(model, prompt, n, cfg, use_cache: bool, repeats: int) -> float:
    rates = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        comps = sample(model, prompt, n, cfg, torch.Generator().manual_seed(i), eos_id=-1,
                       use_cache=use_cache)
        dt = time.perf_counter() - t0
        if i:
            rates.append(sum(len(c.tokens) for c in comps) / dt)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=56)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vllm", action="store_true", help="vLLM vs torch on a small HF model")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.vllm:
        from bench.bench_generate_vllm import run_vllm_bench

        run_vllm_bench(args.hidden, args.layers, args.max_new_tokens, args.repeats, tokens_per_s)
        return
    model, tok = build_model(ModelSection(context_len=64))  # the tiny model
    params = sum(p.numel() for p in model.parameters())
    prompt = tok.encode("abcd>dcba>")[:8]
    cfg = SamplingSection(max_new_tokens=args.max_new_tokens)
    cached = tokens_per_s(model, prompt, args.n, cfg, True, args.repeats)
    full = tokens_per_s(model, prompt, args.n, cfg, False, args.repeats)
    print(f"tiny model: {params} params, n={args.n}, {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)")
    print(f"with KV cache:    {cached:10.0f} tokens/s")
    print(f"without KV cache: {full:10.0f} tokens/s")
    print(f"cache speed-up:   {cached / full:10.2f}x")


if __name__ == "__main__":
    main()
