"""Resumable, interruptible batched decoding: every token with its weight version.

A :class:`Decoder` samples the completions of one prompt one token step at a time
(``step``), so its caller decides what happens between two steps: apply a weight
update, make the tokens so far durable (a segment flush, ``docs/segments.md``), pause
until the controller has recorded them, or stop. Each token records

* the weight version that sampled it (the ``version`` passed to ``step``), and
* its behaviour logprob: log p(token | prefix) under the temperature-scaled model that
  drew it (``workers.batch``'s alignment convention).

**A refit between two steps.** The KV cache holds keys and values computed by the old
weights. ``kv_on_refit`` says what the next step does with it:

* ``recompute`` -- drop it and prefill prompt + completion so far under the new weights:
  the next token's logprob is then exactly the new version's full-forward logprob
  (the quantity the trainer recomputes), at the cost of one prefill per refit;
* ``keep`` -- continue on it: no prefill, but the behaviour distribution of the tokens
  after the refit mixes old keys/values with new weights (still the distribution that
  drew them, so importance weights stay correct; it is just no version's own).

``bench/bench_inflight_kv.py`` measures both; the generator's default is chosen there.

**Resuming.** A decoder may start from recorded prefixes (``RowPrefix``: tokens,
logprobs and versions of each sample, and whether it stopped), e.g. after a crash: the
prefixes are kept as they were, the live rows are prefilled under the current weights,
and sampling continues where they ended. Rows advance in lockstep, so every live row
has the same length; a prefix set that breaks this is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import torch
from torch import nn

from workers.models.config import KV_ON_REFIT, KvOnRefit, SamplingSection
from workers.models.sampling import Completion, draw


@dataclass
class RowPrefix:
    """What one sample already has: its recorded completion tokens (resume input)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"RowPrefix: {len(self.tokens)} tokens, {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions must be equal"
            )


class Decoder:
    """Samples ``n`` completions of ``prompt_ids`` one token step at a time."""

    def __init__(
        self,
        model: nn.Module,
        prompt_ids: list[int] | list[list[int]],
        n: int,
        cfg: SamplingSection,
        generator: torch.Generator,
        eos_id: int,
        *,
        use_cache: bool = True,
        kv_on_refit: KvOnRefit = "recompute",
        prefixes: Sequence[RowPrefix] | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("cannot sample from an empty prompt")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        # one prompt for every row, or one per row (episodes past their first turn):
        # equal lengths keep the rows' positions aligned, so no padding is needed
        per_row = isinstance(prompt_ids[0], list)
        self.prompts: list[list[int]] = (
            [list(p) for p in prompt_ids] if per_row else [list(prompt_ids)] * n  # type: ignore[arg-type]
        )
        if len(self.prompts) != n or len({len(p) for p in self.prompts}) != 1 or not self.prompts[0]:
            raise ValueError(f"expected one prompt or {n} non-empty prompts of equal length")
        if kv_on_refit not in KV_ON_REFIT:
            raise ValueError(f"kv_on_refit must be one of {KV_ON_REFIT}, got {kv_on_refit!r}")
        if prefixes is not None and len(prefixes) != n:
            raise ValueError(f"{len(prefixes)} prefixes for {n} samples")
        self.model, self.cfg, self.generator, self.eos_id = model, cfg, generator, eos_id
        self.use_cache = use_cache
        self.kv_on_refit = kv_on_refit
        self.rows = [RowPrefix(list(p.tokens), list(p.logprobs), list(p.versions), p.stopped)
                     for p in (prefixes or [RowPrefix() for _ in range(n)])]
        for row in self.rows:
            row.stopped = row.stopped or self._ended(row.tokens)
        #: rows in the model batch (a row that stops stays in it, its draws ignored,
        #: until the next prefill rebuilds the batch from the live rows)
        self.batch: list[int] = self.live()
        lengths = {len(self.rows[i].tokens) for i in self.batch}
        if len(lengths) > 1:
            raise ValueError(f"live samples must have equal lengths to resume, got {sorted(lengths)}")
        self._cache = None
        #: [len(batch), prompt + tokens] the batch's sequences as the model sees them
        self._seq: torch.Tensor | None = None
        #: version of the weights the cache was computed with (None: no cache yet)
        self._cache_version: int | None = None
        #: prefills run (the first one, and one per recompute after a refit)
        self.prefills = 0
        self.steps = 0

    def live(self) -> list[int]:
        """Rows still sampling."""
        return [i for i, r in enumerate(self.rows) if not r.stopped]

    @property
    def done(self) -> bool:
        return not any(not r.stopped for r in self.rows)

    def _ended(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] == self.eos_id or len(tokens) >= self.cfg.max_new_tokens

    @torch.no_grad()
    def step(self, version: int) -> None:
        """Sample one token for every live row with the weights of ``version``."""
        if self.done:
            return
        if self._cache is not None and self._cache_version != version and self.kv_on_refit == "recompute":
            self._cache = None  # computed by older weights: prefill again under these
        logits = self._forward()
        self._cache_version = version
        tok, lp = draw(logits, self.cfg, self.generator)
        for j, i in enumerate(self.batch):
            row = self.rows[i]
            if row.stopped:
                continue
            t = int(tok[j])
            row.tokens.append(t)
            row.logprobs.append(float(lp[j]))
            row.versions.append(version)
            row.stopped = self._ended(row.tokens)
        # the next step's input (a stopped row's draw is fed too, and not used)
        self._seq = torch.cat([self._seq, tok[:, None]], dim=1)
        self.steps += 1

    def _forward(self) -> torch.Tensor:
        """Logits [len(batch), V] of the next token of every row in the batch."""
        if self._seq is None or (self.use_cache and self._cache is None):
            # prefill (first step, or a recompute after a refit): rows that stopped
            # leave the batch here, and only here, so the draws' shape is the same
            # with and without a cache
            self.batch = self.live()
            self.prefills += 1
            device = next(self.model.parameters()).device
            seqs = [self.prompts[i] + self.rows[i].tokens for i in self.batch]
            self._seq = torch.tensor(seqs, dtype=torch.int64, device=device)
            ids = self._seq
        elif not self.use_cache:  # every step re-runs the whole prefix
            return self.model(self._seq)[:, -1, :]
        else:
            ids = self._seq[:, -1:]
        logits, self._cache = self.model(ids, past=self._cache, return_cache=True)
        return logits[:, -1, :]

    def close(self) -> None:
        """Free the KV cache (a dropped group; the vLLM decoder aborts its requests)."""
        self._cache = self._seq = None

    def completions(self) -> list[Completion]:
        return completions_of(self.rows, self.eos_id)


def completions_of(rows: Sequence[RowPrefix], eos_id: int) -> list[Completion]:
    """The rows as completions (``stopped``: ended with EOS, not at the budget)."""
    return [
        Completion(
            list(r.tokens),
            torch.tensor(r.logprobs, dtype=torch.float32),
            bool(r.tokens) and r.tokens[-1] == eos_id,
            torch.tensor(r.versions, dtype=torch.int64),
        )
        for r in rows
    ]


def sample(
    model: nn.Module,
    prompt_ids: list[int] | list[list[int]],
    n: int,
    cfg: SamplingSection,
    generator: torch.Generator,
    eos_id: int,
    *,
    use_cache: bool = True,
    between_steps: Callable[[], None] | None = None,
    version: Callable[[], int] = lambda: 0,
    kv_on_refit: KvOnRefit = "keep",
) -> list[Completion]:
    """Sample ``n`` completions of ``prompt_ids`` (one prompt, or ``n`` of equal length,
    one per row) to the end in one call.

    ``between_steps`` runs after every token step (the generator applies weight updates
    there); ``version()`` names the weights each step samples with. ``keep`` is the
    default here because it is what this call did before refits were measured.
    """
    dec = Decoder(
        model, prompt_ids, n, cfg, generator, eos_id, use_cache=use_cache, kv_on_refit=kv_on_refit
    )
    while True:
        dec.step(version())
        if dec.done:
            return dec.completions()
        if between_steps is not None:
            between_steps()
