"""Generator sampling throughput for the tiny model, with and without the KV cache.

Samples one group (``--n`` completions of a short prompt) to ``--max-new-tokens``
without stopping at EOS, so both variants produce the same number of tokens; reports
generated tokens per second (median of ``--repeats``) and the speed-up of the cache.

    python -m bench.bench_generate [--n 8] [--max-new-tokens 56] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.models.factory import ModelConfig, build_model
from workers.models.sampling import SamplingConfig, sample


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = build_model(ModelConfig())  # the default tiny model
    params = sum(p.numel() for p in model.parameters())
    prompt = tok.encode("abcd>dcba>")[:8]
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    cached = tokens_per_s(model, prompt, args.n, cfg, True, args.repeats)
    full = tokens_per_s(model, prompt, args.n, cfg, False, args.repeats)
    print(f"tiny model: {params} params, n={args.n}, {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)")
    print(f"with KV cache:    {cached:10.0f} tokens/s")
    print(f"without KV cache: {full:10.0f} tokens/s")
    print(f"cache speed-up:   {cached / full:10.2f}x")


if __name__ == "__main__":
    main()
