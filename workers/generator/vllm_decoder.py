"""Interruptible generation on vLLM: the engine driven one scheduler step at a time.

``LLM.generate`` runs a batch to the end; a refit could only land between groups (or
between re-submitted chunks, ``rollout.vllm.chunk_tokens``). With partial rollouts the
generator drives the engine itself: one request per sample (``n = 1``, its own seed,
output deltas) added to ``LLM.llm_engine``, and ``step()`` called once per token step.
Between two steps nothing runs in the engine (the in-process engine core steps only
when asked), so the runner (``workers.generator.inflight``) can load new weights
(``_EngineWeights``), flush segments or pause the group there, with the requests and
their KV blocks still in the engine. Each token is tagged with the version the step
ran with. After a refit, ``kv_on_refit`` decides:

* ``keep`` -- the requests go on with their KV blocks (computed by the old weights);
* ``recompute`` -- they are aborted and re-added with prompt + tokens so far, so the
  engine prefills them under the new weights.

Prefix caching is off in this mode (``VllmRuntime.prefix_caching``): a cached block
holds keys and values of the weights that computed it, and the engine cannot reset its
cache while the group's requests are running, so a prefix hit after a refit would be
stale. The multi-process engine core steps on its own and cannot be paused, so
partial rollouts need ``engine_mode = "inprocess"`` (checked by the config).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from workers.models.config import KvOnRefit, SamplingSection
from workers.models.decoder import RowPrefix, completions_of
from workers.models.sampling import Completion

_ids = itertools.count()


class VllmDecoder:
    """One group's samples as engine requests, advanced a scheduler step at a time."""

    def __init__(
        self,
        generator: Any,
        prompt_ids: list[int],
        n: int,
        cfg: SamplingSection,
        seed: int,
        prefixes: Sequence[RowPrefix] | None,
        kv_on_refit: KvOnRefit,
    ) -> None:
        if prefixes is not None and len(prefixes) != n:
            raise ValueError(f"{len(prefixes)} prefixes for {n} samples")
        self.gen, self.cfg, self.seed, self.kv_on_refit = generator, cfg, seed, kv_on_refit
        self.prompt_ids = list(prompt_ids)
        self.eos_id = generator.tokenizer.eos_id
        self.rows = [RowPrefix(list(p.tokens), list(p.logprobs), list(p.versions), p.stopped)
                     for p in (prefixes or [RowPrefix() for _ in range(n)])]
        for row in self.rows:
            row.stopped = row.stopped or self._ended(row.tokens)
        self._tag = f"rlc{next(_ids)}"
        #: engine request id -> row
        self._requests: dict[str, int] = {}
        self._version: int | None = None
        #: requests (re-)added: one per live row at the start and after each recompute
        self.prefills = 0
        self._add_live()

    @property
    def engine(self) -> Any:
        return self.gen.llm.llm_engine

    @property
    def done(self) -> bool:
        return all(r.stopped for r in self.rows)

    def _ended(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] == self.eos_id or len(tokens) >= self.cfg.max_new_tokens

    def _add_live(self) -> None:
        for i, row in enumerate(self.rows):
            if row.stopped:
                continue
            done = len(row.tokens)
            params = self.gen.step_params(
                self.cfg, self.cfg.max_new_tokens - done,
                (self.seed + 7919 * done + 104729 * i) % (2**31 - 1),
            )
            rid = f"{self._tag}-{i}-{done}"
            self.engine.add_request(rid, {"prompt_token_ids": self.prompt_ids + row.tokens}, params)
            self._requests[rid] = i
            self.prefills += 1

    def step(self, version: int) -> None:
        """One engine step (a token for every running sample) with weights ``version``."""
        if self.done:
            return
        if self._version is not None and version != self._version and self.kv_on_refit == "recompute":
            self.close()
            self._add_live()
        self._version = version
        self.gen.threads.pin()  # this thread may be new to the engine (``vllm_threads``)
        for out in self.engine.step():
            i = self._requests.get(out.request_id)
            if i is None:
                raise RuntimeError(f"vLLM engine stepped a request of another group: {out.request_id}")
            row, piece = self.rows[i], out.outputs[0]
            for tok, logprobs in zip(piece.token_ids, piece.logprobs or []):
                row.tokens.append(int(tok))
                row.logprobs.append(float(logprobs[tok].logprob))
                row.versions.append(version)
            if out.finished:
                row.stopped = True
                del self._requests[out.request_id]

    def close(self) -> None:
        """Abort this group's requests still in the engine (idempotent)."""
        if self._requests and self.gen.llm is not None:
            self.engine.abort_request(list(self._requests))
        self._requests.clear()

    def completions(self) -> list[Completion]:
        return completions_of(self.rows, self.eos_id)
