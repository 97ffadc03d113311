"""A refit mid-generation: keep the KV cache, or recompute it under the new weights?

Samples one group (``--n`` completions, ``--tokens`` each, EOS ignored so every run
makes the same number of tokens) three ways in one run, on the same seeds:

  (a) no refit                -- the baseline;
  (b) refit every ``--every`` token steps, ``kv_on_refit = "keep"``: go on with the
      keys/values the old weights computed;
  (c) the same refits, ``kv_on_refit = "recompute"``: prefill prompt + tokens so far
      under the new weights after each refit.

The refits alternate between two weight sets and are loaded into the same model at
the same token boundaries in (b) and (c), so the load cost is the same in both and the
difference is the KV policy alone. Printed: tokens/s of each, (b) and (c) relative to
(a), and how far each token's behaviour logprob is from its version's own full-forward
logprob -- what the trainer recomputes (``workers.batch``): 0 up to float noise for
(c) by construction, measured for (b).

Backends: the torch sampler (``--backend torch``, the tiny model or a wider one with
``--d-model``) and vLLM's CPU build (``--backend vllm``: a small HF Llama stepped by
``workers.generator.vllm_decoder``, refits through ``_EngineWeights``).

    python bench/bench_inflight_kv.py                      # torch, tiny model
    python bench/bench_inflight_kv.py --d-model 256 --layers 4 --tokens 384
    python bench/bench_inflight_kv.py --backend vllm --hidden 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.models.config import ModelSection, SamplingSection  # noqa: E402
from workers.models.decoder import Decoder  # noqa: E402
from workers.models.factory import build_model  # noqa: E402
from workers.models.sampling import sequence_logprobs  # noqa: E402

MODES = ("none", "keep", "recompute")


def deviation(rows, reference) -> tuple[float, float]:
    """(mean, max) |behaviour logprob - its version's full-forward logprob| over tokens.

    ``rows``: (prompt ids, tokens, logprobs, versions); ``reference(v)``: version v's model.
    """
    errs = []
    for prompt, tokens, logprobs, versions in rows:
        ids = torch.tensor(prompt + tokens)
        refs = {v: sequence_logprobs(reference(v), ids)[len(prompt):] for v in set(versions)}
        errs += [abs(lp - float(refs[v][t])) for t, (lp, v) in enumerate(zip(logprobs, versions))]
    return statistics.fmean(errs), max(errs)


def torch_run(args, mode: str, seed: int):
    """One group; returns (seconds excluding loads, rows, prefills)."""
    cfg = ModelSection(context_len=args.tokens + 16, d_model=args.d_model, n_layers=args.layers,
                       n_heads=max(2, args.d_model // 32))
    model, tok = build_model(cfg, 1)
    weights = [build_model(cfg, s)[0].state_dict() for s in (1, 2)]
    prompt = tok.encode("abcd>dcba>")
    sampling = SamplingSection(max_new_tokens=args.tokens)
    dec = Decoder(model, prompt, args.n, sampling, torch.Generator().manual_seed(seed), eos_id=-1,
                  kv_on_refit="keep" if mode == "none" else mode)
    version, loading = 0, 0.0
    t0 = time.perf_counter()
    while not dec.done:
        if mode != "none" and dec.steps and dec.steps % args.every == 0:
            l0 = time.perf_counter()
            version += 1
            model.load_state_dict(weights[version % 2])
            loading += time.perf_counter() - l0
        dec.step(version)
    dt = time.perf_counter() - t0 - loading
    rows = [(prompt, r.tokens, r.logprobs, r.versions) for r in dec.rows]
    return dt, rows, dec.prefills, weights, cfg


def bench_torch(args) -> None:
    refs: list = []
    results: dict = {m: [] for m in MODES}
    for rep in range(args.repeats + 1):
        for mode in MODES:
            dt, rows, prefills, weights, cfg = torch_run(args, mode, seed=rep)
            if rep:
                results[mode].append(dt)
            if rep == 1:
                for state in weights[len(refs):]:
                    refs.append(build_model(cfg)[0])
                    refs[-1].load_state_dict(state)
                results[mode + "_dev"] = deviation(rows, lambda v: refs[v % 2])
                results[mode + "_prefills"] = prefills
    params = sum(t.numel() for t in weights[0].values())
    print(f"torch sampler: {params} params (d_model {args.d_model}, {args.layers} layers), "
          f"n={args.n}, {args.tokens} tokens, refit every {args.every} steps, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}")
    _report(args, results)


def _report(args, results) -> None:
    tokens = args.n * args.tokens
    base = statistics.median(results["none"])
    print(f"{'mode':>10} {'tokens/s':>10} {'vs none':>8} {'prefills':>8} "
          f"{'|lp - exact| mean':>18} {'max':>9}")
    for mode in MODES:
        t = statistics.median(results[mode])
        mean, worst = results[mode + "_dev"]
        print(f"{mode:>10} {tokens / t:>10.0f} {base / t:>8.2f} {results[mode + '_prefills']:>8} "
              f"{mean:>18.2e} {worst:>9.2e}")
    keep, recompute = (statistics.median(results[m]) for m in ("keep", "recompute"))
    print(f"recompute / keep time: {recompute / keep:.3f}x")


def bench_vllm(args) -> None:
    from bench.bench_inflight_vllm import vllm_results

    with tempfile.TemporaryDirectory() as tmp:
        results = vllm_results(args, Path(tmp), MODES, deviation)
    _report(args, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--every", type=int, default=32, help="token steps between refits")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128, help="vLLM model's hidden size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (bench_vllm if args.backend == "vllm" else bench_torch)(args)


if __name__ == "__main__":
    main()
