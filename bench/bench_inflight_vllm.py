"""The ``--backend vllm`` rows of ``bench_inflight_kv``: vLLM's CPU build, stepped by hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from workers.api import GenerationRequest
from workers.dataplane import MemoryDataPlane
from workers.generator.config import VllmSection
from workers.generator.inflight import InflightRunner
from workers.generator.vllm_backend import VllmGenerator
from workers.generator.vllm_config import VllmRuntime
from workers.models.config import SamplingSection
from workers.models.hf import load_hf, load_hf_tokenizer
from workers.models.hf_tiny import write_tiny_hf_model
from workers.tasks import Example, make_task
from workers.weight_sync import cpu_state_dict


def _two_versions(path: Path) -> list[Any]:
    """The directory's weights and a perturbed copy (HF modules: the references)."""
    a, _ = load_hf(path)
    b, _ = load_hf(path)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return [a, b]


def _group(gen: VllmGenerator, runner: InflightRunner, args: Any, seed: int, refits: bool) -> float:
    """Drive one group to the end as the controller would; seconds, loads excluded."""
    states = [cpu_state_dict(m) for m in gen.refs]
    loading = [0.0]
    steps = [0]

    def on_step(_group: str) -> None:
        steps[0] += 1
        if refits and steps[0] % args.every == 0:
            l0 = time.perf_counter()
            v = gen.weight_version + 1
            gen.update_weights(v, states[v % 2])
            loading[0] += time.perf_counter() - l0

    runner.on_step = on_step
    sampling = SamplingSection(max_new_tokens=args.tokens)
    example = Example(prompt="abcd>dcba>", answer="")
    flushes = 0
    t0 = time.perf_counter()
    while True:
        req = GenerationRequest(group_id=f"g{seed}{refits}", attempt=1, prompt_index=0,
                                n_samples=args.n, seed=seed, flushes=flushes)
        out = runner.advance([req], [example], sampling)[0]
        if out.status == "done":
            break
        flushes += 1
    gen.last = out  # type: ignore[attr-defined]
    return time.perf_counter() - t0 - loading[0]


def vllm_results(args: Any, tmp: Path, modes: tuple[str, ...], deviation: Callable) -> dict:
    path = write_tiny_hf_model(tmp / "llama", hidden_size=args.hidden, num_layers=args.layers,
                               context_len=args.tokens + 16)
    gen = VllmGenerator(
        str(path), load_hf_tokenizer(path), make_task("reverse"), MemoryDataPlane(), "bench",
        options=VllmSection(kv_cache_mib=64, max_num_seqs=max(16, args.n)),
        runtime=VllmRuntime(prefix_caching=False),
        num_threads=args.threads,
    )
    gen.refs = _two_versions(path)  # type: ignore[attr-defined]
    base_params = gen.step_params

    def no_eos(cfg, max_tokens, seed):  # every run makes the same number of tokens
        params = base_params(cfg, max_tokens, seed)
        params.ignore_eos, params.stop_token_ids = True, []
        return params

    gen.step_params = no_eos  # type: ignore[method-assign]
    runner = InflightRunner(gen, segment_tokens=10**6)
    results: dict = {m: [] for m in modes}
    try:
        for rep in range(args.repeats + 1):
            for mode in modes:
                gen.kv_on_refit = "keep" if mode == "none" else mode
                gen.update_weights(gen.weight_version + 2 - gen.weight_version % 2,
                                   cpu_state_dict(gen.refs[0]))  # every run starts on A
                dt = _group(gen, runner, args, seed=rep, refits=mode != "none")
                if rep:
                    results[mode].append(dt)
                if rep == 1:
                    rows = gen.dataplane.get("bench", gen.last.payload_keys)
                    results[mode + "_dev"] = deviation(
                        [_row(r) for r in rows], lambda v: gen.refs[v % 2])
                    results[mode + "_prefills"] = "-"
    finally:
        gen.close()
    print(f"vLLM CPU build: HF Llama hidden {args.hidden}, {args.layers} layers, n={args.n}, "
          f"{args.tokens} tokens, refit every {args.every} steps, median of {args.repeats}")
    return results


def _row(row: dict) -> tuple[list[int], list[int], list[float], list[int]]:
    """A final row as (prompt, completion tokens, their logprobs, their versions)."""
    p = int(row["prompt_len"])
    ids = row["input_ids"].tolist()
    return (ids[:p], ids[p:], row["generator_logprobs"][p:].tolist(),
            row["token_versions"][p:].tolist())
