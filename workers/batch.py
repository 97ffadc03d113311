"""The tensors that cross from generators to the trainer.

Two shapes of the same data, both ``tensordict`` types (TransferQueue's own):

* **sample rows** -- what a generator writes to the data plane for one completion
  (:data:`ROW_FIELDS`), 1-D per sample, jagged across samples. The data plane hands a
  microbatch's rows to the trainer as ONE ``TensorDict`` of batch size ``[B]``, jagged
  fields as nested tensors (``DataPlane.get_batch``);
* a :class:`TrainBatch` -- a ``tensorclass`` (a typed ``TensorDict``): those rows
  right-padded to a common length by ``TensorDict.to_padded_tensor``, plus the
  per-sample advantage the controller computed from the group's rewards. Indexing
  (``batch[2:5]``) selects rows of every field at once.

Alignment convention (shared by generator, trainer and loss): position ``t`` of
``input_ids`` is the token; ``generator_logprobs[t]`` is log p(input_ids[t] | input_ids[<t])
under the weights that sampled it (its behaviour logprob); ``token_versions[t]`` is the
version of those weights (-1 on prompt, observation and padding positions);
``loss_mask[t]`` is True for completion tokens (never for t = 0, prompt tokens or
padding). Logits at ``t - 1`` predict token ``t``. A sample generated across a refit
has tokens of two versions, each with its own behaviour logprob (``docs/segments.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDictBase, tensorclass

from workers.dataplane.api import batch_of

#: Fields of one payload row in the data plane, with their dtypes.
ROW_FIELDS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,  # [T] prompt + completion
    "loss_mask": torch.bool,  # [T] True on completion tokens
    "generator_logprobs": torch.float32,  # [T] 0 where loss_mask is False
    "token_versions": torch.int64,  # [T] -1 where no model sampled the token
    "reward": torch.float32,  # [] scalar
    "prompt_len": torch.int64,  # []
    "completion_len": torch.int64,  # []
}


#: row fields a writer older than per-token versions did not write (read if present)
OPTIONAL_ROW_FIELDS = frozenset({"token_versions"})

#: fields of a TrainBatch that are [B, T] (the rest, ``advantages``, is [B])
_PER_TOKEN = (
    "input_ids", "attention_mask", "loss_mask", "generator_logprobs", "reference_logprobs",
    "token_versions",
)


@tensorclass
class TrainBatch:
    """A padded batch of B samples of length T (T = longest sample); batch size [B]."""

    input_ids: torch.Tensor  # [B, T] int64, pad = 0
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    loss_mask: torch.Tensor  # [B, T] bool
    generator_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    #: [B, T] float32 logprobs under the frozen reference model (only with a KL penalty)
    reference_logprobs: torch.Tensor | None = None
    #: [B, T] int64 weight version of each token (-1 off the loss mask; None: rows
    #: written before versions were recorded)
    token_versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for name in (*_PER_TOKEN, "advantages"):
            value = getattr(self, name)
            if value is None:
                continue
            want = (b,) if name == "advantages" else (b, t)
            if tuple(value.shape) != want:
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(value.shape)}, expected {want}"
                )
        self.batch_size = torch.Size([b])

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Valid (loss-bearing) tokens."""
        return int(self.loss_mask.sum())

    def select(self, index: slice | torch.Tensor) -> TrainBatch:
        """Rows ``index`` as a new batch (used to split into microbatches)."""
        return self[index]


def collate(
    rows: TensorDictBase | Sequence[Mapping[str, torch.Tensor]], advantages: list[float]
) -> TrainBatch:
    """Right-pad sample rows (``ROW_FIELDS``; a batch TensorDict or one mapping per row)
    into a TrainBatch."""
    if not isinstance(rows, TensorDictBase):
        rows = list(rows)
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        names = ["input_ids", "loss_mask", "generator_logprobs"]
        names += [n for n in OPTIONAL_ROW_FIELDS if all(n in r for r in rows)]
        rows = batch_of({n: [r[n] for r in rows] for n in names}, len(rows))
    b = int(rows.batch_size[0]) if rows.batch_dims else 0
    if b == 0:
        raise ValueError("cannot collate an empty list of rows")
    if b != len(advantages):
        raise ValueError(f"{b} rows but {len(advantages)} advantages")
    ids = rows.get("input_ids")
    lengths = ids.offsets().diff() if ids.is_nested else torch.full((b,), ids.shape[1])
    padded = rows.select("input_ids", "loss_mask", "generator_logprobs").to_padded_tensor(0)
    t = padded.get("input_ids").shape[1]
    attention = torch.arange(t) < lengths.unsqueeze(1)
    versions = None
    if "token_versions" in rows.keys():
        versions = rows.select("token_versions").to_padded_tensor(-1).get("token_versions")
        versions = versions.to(torch.int64).reshape(b, t)
    return TrainBatch(
        input_ids=padded.get("input_ids").to(torch.int64),
        attention_mask=attention,
        loss_mask=padded.get("loss_mask").to(torch.bool),
        generator_logprobs=padded.get("generator_logprobs").to(torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        token_versions=versions,
    )
