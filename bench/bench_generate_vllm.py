"""The ``--vllm`` column of ``bench_generate``: vLLM vs the torch sampler, and refit time."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import torch

from workers.dataplane import MemoryDataPlane
from workers.generator.generator import Generator
from workers.handles import LocalHandle
from workers.models.config import SamplingSection
from workers.models.hf import load_hf, load_hf_tokenizer
from workers.models.hf_tiny import write_tiny_hf_model
from workers.tasks import make_task
from workers.weight_sync import cpu_state_dict
from workers.weight_transport import BucketTransport, RefitSource

BATCHES = (1, 64)
BUCKET_BYTES = 16 * 1024 * 1024


def _vllm_tokens_per_s(gen, prompt, n: int, max_new: int, repeats: int) -> float:
    import vllm

    rates = []
    for i in range(repeats + 1):
        params = vllm.SamplingParams(n=n, max_tokens=max_new, ignore_eos=True, seed=i,
                                     logprobs=0, detokenize=False)
        t0 = time.perf_counter()
        out = gen.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        if i:
            rates.append(sum(len(o.token_ids) for o in out.outputs) / dt)
    return statistics.median(rates)


def _refit_s_per_mb(trainer_model, generator, version: int, repeats: int) -> tuple[float, float]:
    """(seconds per MB, MB) of one bucketed refit, trainer export to generator ack."""
    mb = sum(t.numel() * t.element_size() for t in trainer_model.state_dict().values()) / 1e6
    trainer = LocalHandle(RefitSource(lambda: cpu_state_dict(trainer_model)))
    target = [LocalHandle(generator, threads=2)]
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        asyncio.run(BucketTransport(BUCKET_BYTES).send(version + i, trainer, target))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / mb, mb


def run_vllm_bench(hidden: int, layers: int, max_new: int, repeats: int, torch_rate) -> None:
    from workers.generator.vllm_backend import VllmGenerator
    from workers.generator.config import VllmSection

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_hf_model(tmp, hidden_size=hidden, num_layers=layers,
                                   intermediate_size=4 * hidden, context_len=max_new + 16)
        model, tok = load_hf(path)
        params = sum(p.numel() for p in model.parameters())
        prompt = tok.encode("abcd>")
        task, plane = make_task("reverse"), MemoryDataPlane()
        vgen = VllmGenerator(str(path), load_hf_tokenizer(path), task, plane, "bench",
                             options=VllmSection(max_num_seqs=max(BATCHES), kv_cache_mib=256))
        print(f"HF Llama: {params} params, hidden {hidden}, {layers} layers, {max_new} new "
              f"tokens, torch threads {torch.get_num_threads()}")
        print(f"{'batch':>5} {'torch tok/s':>12} {'vLLM tok/s':>12} {'vLLM/torch':>10}")
        for n in BATCHES:
            cfg = SamplingSection(max_new_tokens=max_new)
            t = torch_rate(model, prompt, n, cfg, True, repeats)
            v = _vllm_tokens_per_s(vgen, prompt, n, max_new, repeats)
            print(f"{n:>5} {t:>12.0f} {v:>12.0f} {v / t:>10.2f}")
        new, _ = load_hf(path)
        with torch.no_grad():
            for p in new.parameters():
                p.mul_(1.01)
        tgen = Generator(load_hf(path)[0], tok, task, plane, "bench")
        v_s, mb = _refit_s_per_mb(new, vgen, 1, 3)
        t_s, _ = _refit_s_per_mb(new, tgen, 1, 3)
        print(f"refit ({mb:.1f} MB, {BUCKET_BYTES >> 20} MiB buckets): vLLM {v_s * 1e3:.1f} ms/MB, "
              f"torch generator {t_s * 1e3:.1f} ms/MB, ratio {v_s / t_s:.2f}")
        vgen.close()

