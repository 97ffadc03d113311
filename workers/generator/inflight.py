"""Partial rollouts on the generator: groups that pause at every durable flush point.

With ``rollout.partial`` on (``docs/segments.md``), a generator call does not run its
groups to the end in one go. :class:`InflightRunner` advances them in order, one token
step at a time (a ``Decoder``: ``workers.models.decoder``, or vLLM's), and **returns at
the first flush point**: a sample has ``segment_tokens`` tokens that are not durable yet.

A refit lands between two token steps and closes a segment (one version per segment)
in memory; it is made durable at the next flush point, one version per flush, or not at
all when the group ends first (its final rows carry every token's version). A refit
alone adds no flush: that would buy no durability (a crash can still lose up to
``segment_tokens`` per sample) for a call, a put and an event per group in flight at
every refit -- 0.9 flushes per group in ``bench_async`` without a tail, 8-10 % of the
generators' time under Ray. ``flush_on_refit`` (``rollout.partial``) brings that
cadence back.

At a flush point the oldest version's new tokens of every sample go to the data plane
(and its spill) as segment rows, in one ``put``; the call returns them (``status = "flushed"``) and the
group stays here, paused, until the controller has recorded them and calls again with
the same group (``flushes`` = how many it recorded). So at most one flush window per
sample is ever not in the log: that is all a crash can lose. A finished group writes its
final rows as before (``status = "done"``); groups after the one that flushed are not
started in this call (``"pending"``).

A group this worker does not hold -- a new attempt, or one after a crash -- starts from
the recorded flushes the request carries (``resume``): their rows are read back and
checked against the log, the samples' prefixes are prefilled under the current weights,
and sampling continues where they ended. A continue request for a group it does not hold
(this worker was replaced) is refused rather than sampling recorded tokens again; the
controller then fails that attempt and re-admits the group with ``resume``.

``RLC_TOKEN_LEDGER=path`` (a test hook, off by default) appends one line
``group attempt tokens`` per token step to ``path``, written before the step's tokens
can be flushed, so chaos tests can count what a killed process sampled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from events.schema import Segment
from workers.api import GenerationOutcome, GenerationRequest, SegmentFlush, error_line
from workers.errors import GroupError
from workers.generator.segments import load_prefixes, oldest_run, segment_key, segment_rows
from workers.models.config import SamplingSection
from workers.models.decoder import RowPrefix
from workers.models.sampling import Completion
from workers.tasks.base import Example


class InflightStateLost(RuntimeError):
    """Asked to continue a group whose in-memory state this worker does not hold."""


class StepDecoder(Protocol):
    """What the runner drives: the torch ``Decoder`` or the vLLM one."""

    rows: list[RowPrefix]

    @property
    def done(self) -> bool: ...
    def step(self, version: int) -> None: ...
    def completions(self) -> list[Completion]: ...
    def close(self) -> None: ...


@dataclass
class _Held:
    attempt: int
    example: Example
    prompt_ids: list[int]
    decoder: StepDecoder
    #: flushes of this attempt so far (each recorded before the group went on)
    flushes: int
    #: per sample, tokens already durable (recorded flushes, resumed prefixes included)
    durable: list[int]
    #: the next token step's simulated time is spent (a flush may come between the two)
    decode_paid: bool = False


def _tokens(rows: Sequence[RowPrefix]) -> int:
    return sum(len(r.tokens) for r in rows)


def _pending() -> GenerationOutcome:
    return GenerationOutcome(
        payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
        weight_version_end=0, status="pending",
    )


class InflightRunner:
    """Advances a call's groups to their next flush point (see the module docstring)."""

    def __init__(self, generator: Any, segment_tokens: int, flush_on_refit: bool = False) -> None:
        if segment_tokens < 1:
            raise ValueError(f"rollout.partial.segment_tokens must be >= 1, got {segment_tokens}")
        self.gen = generator
        self.segment_tokens = segment_tokens
        self.flush_on_refit = flush_on_refit
        self.held: dict[str, _Held] = {}
        #: tokens sampled / made durable by flushes, over this worker's life
        self.tokens_sampled = 0
        self.tokens_flushed = 0
        #: test hook, called after every token step with the group id
        self.on_step: Callable[[str], None] | None = None
        ledger = os.environ.get("RLC_TOKEN_LEDGER")
        self._ledger = None if not ledger else os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def advance(
        self, reqs: Sequence[GenerationRequest], examples: Sequence[Example], sampling: SamplingSection
    ) -> list[GenerationOutcome]:
        """Run ``reqs`` in order until one flushes or all are done; one outcome each."""
        wanted = {r.group_id for r in reqs}
        outs: list[GenerationOutcome] = []
        with self.gen.session():
            for gid in [g for g in self.held if g not in wanted]:
                self.held.pop(gid).decoder.close()  # the controller moved on (failed, fenced)
            for req, example in zip(reqs, examples):
                flushed = any(o.status == "flushed" for o in outs)
                outs.append(_pending() if flushed else self._run(req, example, sampling))
        return outs

    def _hold(self, req: GenerationRequest, example: Example, sampling: SamplingSection) -> _Held:
        held = self.held.get(req.group_id)
        if held is not None and held.attempt == req.attempt and held.flushes == req.flushes:
            return held
        if held is not None:  # an older attempt (the controller failed it): gone
            self.held.pop(req.group_id).decoder.close()
        if req.flushes > 0:
            raise InflightStateLost(
                f"group {req.group_id} attempt {req.attempt}: this worker does not hold it "
                f"after {req.flushes} recorded flushes (replaced?); re-admit it to resume"
            )
        prompt_ids = self.gen.prompt_ids(example, sampling)
        prefixes = None
        if req.resume:
            prefixes = load_prefixes(self.gen.dataplane, self.gen.run_id, req.resume, req.n_samples)
        decoder = self.gen.new_decoder(prompt_ids, req.n_samples, sampling, req.seed, prefixes)
        durable = [len(r.tokens) for r in decoder.rows]
        held = _Held(req.attempt, example, prompt_ids, decoder, 0, durable)
        self.held[req.group_id] = held
        return held

    def _run(
        self, req: GenerationRequest, example: Example, sampling: SamplingSection
    ) -> GenerationOutcome:
        held = self._hold(req, example, sampling)
        weights = self.gen.weights
        weights.begin_group()
        try:
            while not held.decoder.done:
                if self._flush_due(held, weights.version):
                    return self._flush(req, held)
                if not held.decode_paid:
                    # the next token's simulated time first; a refit landing in it closes
                    # the segment before that token (the check above, once more)
                    self.gen.simulated_decode(held.example, sampling)
                    held.decode_paid = True
                    continue
                held.decode_paid = False
                before = _tokens(held.decoder.rows)
                held.decoder.step(weights.version)
                sampled = _tokens(held.decoder.rows) - before
                self.tokens_sampled += sampled
                if self._ledger is not None:
                    os.write(self._ledger, f"{req.group_id} {req.attempt} {sampled}\n".encode())
                if self.on_step is not None:
                    self.on_step(req.group_id)
                weights.at_step_boundary()
        finally:
            weights.end_group()
        self.held.pop(req.group_id).decoder.close()
        try:
            result = self.gen.store_group(
                req.group_id, req.attempt, held.example, held.prompt_ids,
                held.decoder.completions(), weights.version,
            )
        except GroupError as err:  # its reward: this group fails, the call goes on
            return GenerationOutcome.failed(error_line(err))
        return GenerationOutcome(
            payload_keys=list(result.keys), rewards=list(result.rewards),
            lengths=list(result.completion_lens),
            weight_version_start=result.weight_version_start,
            weight_version_end=result.weight_version_end,
            version_runs=result.version_runs,
        )

    def _flush_due(self, held: _Held, version: int) -> bool:
        """A window is full (or, with ``flush_on_refit``, new tokens exist and a refit
        landed after them)."""
        for row, durable in zip(held.decoder.rows, held.durable):
            fresh = len(row.tokens) - durable
            if fresh and (
                fresh >= self.segment_tokens or (self.flush_on_refit and row.versions[-1] != version)
            ):
                return True
        return False

    def _flush(self, req: GenerationRequest, held: _Held) -> GenerationOutcome:
        """Store the oldest version's new tokens as segment rows (one put); the group
        pauses here. A window that spans refits is flushed one version at a time, the
        newer tokens at the next call (or in the group's final rows)."""
        rows = held.decoder.rows
        version, until = oldest_run(rows, held.durable)
        new = segment_rows(rows, held.durable, until)
        gen, index = self.gen, held.flushes
        keys = {i: segment_key(gen.run_id, req.group_id, req.attempt, i, index) for i in new}
        tags = [
            {"group": req.group_id, "attempt": req.attempt, "sample": i, "index": index,
             "kind": "model", "version": version, "turn": 0}
            for i in new
        ]
        gen.dataplane.put(gen.run_id, list(keys.values()), list(new.values()), tags)
        segments = [
            Segment(sample=i, start=held.durable[i], length=until[i] - held.durable[i],
                    key=keys[i], stopped=rows[i].stopped and until[i] == len(rows[i].tokens))
            for i in new
        ]
        for i in new:
            self.tokens_flushed += until[i] - held.durable[i]
            held.durable[i] = until[i]
        held.flushes += 1
        return GenerationOutcome(
            payload_keys=[], rewards=[], lengths=[], weight_version_start=version,
            weight_version_end=version, status="flushed",
            flush=SegmentFlush(kind="model", weight_version=version, segments=segments),
        )
