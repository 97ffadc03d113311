"""The tensors that cross from generators to the trainer.

Two shapes of the same data, both ``tensordict`` types (TransferQueue's own):

* **sample rows** -- what a generator writes to the data plane for one completion
  (:data:`ROW_FIELDS`), 1-D per sample, jagged across samples. The data plane hands a
  microbatch's rows to the trainer as ONE ``TensorDict`` of batch size ``[B]``, jagged
  fields as nested tensors (``DataPlane.get_batch``);
* a :class:`TrainBatch` -- a ``tensorclass`` (a typed ``TensorDict``): those rows
  right-padded to a common length by ``TensorDict.to_padded_tensor``, plus the
  advantages: one per sample (the controller's group-normalised rewards) or any
  per-token values (per-turn rewards, token-level baselines). Indexing (``batch[2:5]``)
  selects rows of every field at once.

Alignment convention (shared by generator, trainer and loss): position ``t`` of
``input_ids`` is the token; ``generator_logprobs[t]`` is log p(input_ids[t] | input_ids[<t])
under the weights that sampled it (its behaviour logprob); ``token_versions[t]`` is the
version of those weights (-1 on prompt and observation positions); ``loss_mask[t]`` is
True for completion tokens (never for t = 0, prompt tokens or padding). Logits at
``t - 1`` predict token ``t``. A sample generated across a refit has tokens of two
versions, each with its own behaviour logprob (``docs/segments.md``).
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

#: fields of a TrainBatch that are [B, T] (``advantages`` is [B] or [B, T])
_PER_TOKEN = (
    "input_ids", "attention_mask", "loss_mask", "generator_logprobs", "reference_logprobs",
    "token_versions",
)
#: every tensor field of a TrainBatch
_FIELDS = (*_PER_TOKEN, "advantages", "sample_versions")


@tensorclass
class TrainBatch:
    """A padded batch of B samples of length T (T = longest sample); batch size [B]."""

    input_ids: torch.Tensor  # [B, T] int64, pad = 0
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    loss_mask: torch.Tensor  # [B, T] bool
    generator_logprobs: torch.Tensor  # [B, T] float32
    #: [B] float32, one per sample, or [B, T] float32, one per token (aligned like
    #: ``loss_mask``; values outside it are ignored)
    advantages: torch.Tensor
    #: [B, T] float32 logprobs under the frozen reference model (only with a KL penalty)
    reference_logprobs: torch.Tensor | None = None
    #: [B] int64: the weight version each sample's generation started at (its group's
    #: ``weight_version_start``); None = unknown
    sample_versions: torch.Tensor | None = None
    #: [B, T] int64: the weight version that generated each token; when None every token
    #: has its sample's version
    token_versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for name in (*_PER_TOKEN, "advantages", "sample_versions"):
            value = getattr(self, name)
            if value is None:
                continue
            want = [(b, t)] if name in _PER_TOKEN else [(b,)]
            if name == "advantages":
                want.append((b, t))
            if tuple(value.shape) not in want:
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(value.shape)}, expected "
                    + " or ".join(str(w) for w in want)
                )
        self.batch_size = torch.Size([b])

    def token_advantages(self) -> torch.Tensor:
        """[B, T] advantages: per-token values as they are, a per-sample one broadcast."""
        adv = self.advantages
        return adv if adv.dim() == 2 else adv.unsqueeze(1).expand(self.loss_mask.shape)

    def trimmed(self, length: int) -> TrainBatch:
        """The first ``length`` positions of every per-token field (drops right padding)."""
        def cut(v: torch.Tensor | None) -> torch.Tensor | None:
            return v if v is None or v.dim() == 1 else v[:, :length]

        return TrainBatch(**{n: cut(getattr(self, n)) for n in _FIELDS})

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
    rows: TensorDictBase | Sequence[Mapping[str, torch.Tensor]],
    advantages: Sequence[float],
    versions: Sequence[int] | None = None,
    turn_advantages: Sequence[Sequence[float]] | None = None,
) -> TrainBatch:
    """Right-pad sample rows (``ROW_FIELDS``; a batch TensorDict or one mapping per row)
    into a TrainBatch, with one advantage and (optionally) one weight version per row.
    Rows that carry per-token ``token_versions`` keep them (padding is never a loss token).
    With ``turn_advantages`` (``workers.api.MicrobatchRef``) the advantages are [B, T]."""
    names = ["input_ids", "loss_mask", "generator_logprobs"]
    if turn_advantages:
        names.append("prompt_len")
    if not isinstance(rows, TensorDictBase):
        rows = list(rows)
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        names += ["token_versions"] if "token_versions" in rows[0] else []
        rows = batch_of({n: [r[n] for r in rows] for n in names}, len(rows))
    elif "token_versions" in rows.keys():
        names.append("token_versions")
    b = int(rows.batch_size[0]) if rows.batch_dims else 0
    if b == 0:
        raise ValueError("cannot collate an empty list of rows")
    if b != len(advantages):
        raise ValueError(f"{b} rows but {len(advantages)} advantages")
    if versions and b != len(versions):
        raise ValueError(f"{b} rows but {len(versions)} weight versions")
    ids = rows.get("input_ids")
    lengths = ids.offsets().diff() if ids.is_nested else torch.full((b,), ids.shape[1])
    padded = rows.select(*(n for n in names if n != "prompt_len")).to_padded_tensor(0)
    t = padded.get("input_ids").shape[1]
    token_versions = padded.get("token_versions", None)
    adv = torch.tensor(advantages, dtype=torch.float32)
    if turn_advantages:
        if len(turn_advantages) != b:
            raise ValueError(f"{b} rows but {len(turn_advantages)} per-turn advantage runs")
        adv = _per_token(adv, turn_advantages, rows.get("prompt_len").reshape(-1).tolist(), t)
    return TrainBatch(
        input_ids=padded.get("input_ids").to(torch.int64),
        attention_mask=torch.arange(t) < lengths.unsqueeze(1),
        loss_mask=padded.get("loss_mask").to(torch.bool),
        generator_logprobs=padded.get("generator_logprobs").to(torch.float32),
        advantages=adv,
        sample_versions=torch.tensor(versions, dtype=torch.int64) if versions else None,
        token_versions=None if token_versions is None else token_versions.to(torch.int64),
    )


def _per_token(
    per_sample: torch.Tensor, runs: Sequence[Sequence[float]], prompt_lens: Sequence[int], t: int
) -> torch.Tensor:
    """[B, T] advantages: a row's run ``[start_1, a_1, ...]`` gives completion tokens from
    ``start_j`` on ``a_j`` (up to the next start); a row without a run has its per-sample
    value everywhere. Positions off the loss mask are never read."""
    out = per_sample.unsqueeze(1).expand(len(per_sample), t).clone()
    for i, run in enumerate(runs):
        if not run:
            continue
        p, starts, values = int(prompt_lens[i]), run[0::2], run[1::2]
        out[i] = 0.0
        for j, (start, value) in enumerate(zip(starts, values)):
            end = p + int(starts[j + 1]) if j + 1 < len(starts) else t
            out[i, p + int(start):end] = value
    return out
