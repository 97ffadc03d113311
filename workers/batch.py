"""The tensors that cross from generators to the trainer.

Two shapes of the same data:

* a **sample row** -- what a generator writes to the data plane for one completion
  (:data:`ROW_FIELDS`), 1-D per sample, jagged across samples;
* a :class:`TrainBatch` -- rows right-padded to a common length and stacked, plus the
  per-sample advantage the controller computed from the group's rewards.

Alignment convention (shared by generator, trainer and loss): position ``t`` of
``input_ids`` is the token; ``generator_logprobs[t]`` is log p(input_ids[t] | input_ids[<t])
under the generator's weights; ``loss_mask[t]`` is True for completion tokens (never for
t = 0, prompt tokens or padding). Logits at ``t - 1`` predict token ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

#: Fields of one payload row in the data plane, with their dtypes.
ROW_FIELDS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,  # [T] prompt + completion
    "loss_mask": torch.bool,  # [T] True on completion tokens
    "generator_logprobs": torch.float32,  # [T] 0 where loss_mask is False
    "reward": torch.float32,  # [] scalar
    "prompt_len": torch.int64,  # []
    "completion_len": torch.int64,  # []
}


@dataclass(frozen=True)
class TrainBatch:
    """A padded batch of B samples of length T (T = longest sample)."""

    input_ids: torch.Tensor  # [B, T] int64, pad = 0
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    loss_mask: torch.Tensor  # [B, T] bool
    generator_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    #: [B, T] float32 logprobs under the frozen reference model (only with a KL penalty)
    reference_logprobs: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Valid (loss-bearing) tokens."""
        return int(self.loss_mask.sum())

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            want = (b,) if f.name == "advantages" else (b, t)
            if tuple(value.shape) != want:
                raise ValueError(
                    f"TrainBatch.{f.name} has shape {tuple(value.shape)}, expected {want}"
                )

    def select(self, index: slice | torch.Tensor) -> "TrainBatch":
        """Rows ``index`` as a new batch (used to split into microbatches)."""
        ref = None if self.reference_logprobs is None else self.reference_logprobs[index]
        return TrainBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            loss_mask=self.loss_mask[index],
            generator_logprobs=self.generator_logprobs[index],
            advantages=self.advantages[index],
            reference_logprobs=ref,
        )


def collate(rows: list[dict[str, torch.Tensor]], advantages: list[float]) -> TrainBatch:
    """Right-pad sample rows (``ROW_FIELDS``) into a TrainBatch."""
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    if len(rows) != len(advantages):
        raise ValueError(f"{len(rows)} rows but {len(advantages)} advantages")
    t = max(int(r["input_ids"].shape[0]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, t, dtype=torch.int64)
    att = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lp = torch.zeros(b, t, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = int(r["input_ids"].shape[0])
        ids[i, :n] = r["input_ids"]
        att[i, :n] = True
        mask[i, :n] = r["loss_mask"].to(torch.bool)
        lp[i, :n] = r["generator_logprobs"].to(torch.float32)
    return TrainBatch(
        input_ids=ids,
        attention_mask=att,
        loss_mask=mask,
        generator_logprobs=lp,
        advantages=torch.tensor(advantages, dtype=torch.float32),
    )
