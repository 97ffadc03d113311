"""The values events carry: typed ids and the nested records of segments and episodes.

Not events themselves: ``events.schema`` builds its events from them (and re-exports
them), and workers hand the controller the same values (``workers.api``), so one shape
serves both sides. Pure data.
"""

from __future__ import annotations

from typing import Any, Literal, NewType

import msgspec

# Ids that mean something: the fields below are typed with them, so a step number is
# not passed where a weight version belongs. On the wire they are the plain str / int.
GroupId = NewType("GroupId", str)
WeightVersion = NewType("WeightVersion", int)
TrainerVersion = NewType("TrainerVersion", int)
Epoch = NewType("Epoch", int)
Position = NewType("Position", int)

SegmentKind = Literal["model", "observation"]

# The four structs below are written with ``omit_defaults``: a field at its default is
# left out of the JSON (and of snapshots), so a pause of 16 samples is about a quarter
# fewer bytes (``docs/segments.md``, "Fields that may be left out"). That makes every
# default here part of the log format: never change one, or an entry written without
# the field would read differently. Events themselves write every field (a missing
# ``schema_version`` would read as the current one).


class Segment(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One sample's contiguous tokens of one flush (``docs/segments.md``).

    Not an event: ``SegmentsRecorded`` carries a list of them, and generators hand the
    controller the same values (``workers.api``), so one shape serves both.
    """

    #: sample index in the group
    sample: int
    #: offset of the first token in the sample's completion (tokens after the prompt)
    start: int
    #: tokens in this segment (>= 1)
    length: int
    #: data-plane key of the segment row (tokens, logprobs)
    key: str
    #: episode turn (0 for single-turn rollouts)
    turn: int = 0
    #: the sample ended with this segment (EOS, budget, or the episode is done)
    stopped: bool = False


class EnvCall(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One environment/tool call of an episode, as its intent records it (``docs/agents.md``).

    Its idempotency key is (run, group, sample, turn) -- plus ``restart`` once the
    sample's episode was started again from the prompt (``EpisodesRestarted``), so a
    restarted episode's calls are new calls, never repeats of the old ones.
    """

    sample: int
    #: the model turn this step answers (1, 2, ...)
    turn: int
    #: fingerprint of the request (the context the model continued and its action): a
    #: replayed agent must ask exactly this again
    request: str
    #: times the sample's episode was restarted from the prompt
    restart: int = 0


class EnvResult(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """What one environment/tool call returned: the turn's reward, and how it goes on."""

    sample: int
    turn: int
    #: this step's reward (the episode's return is the sum over its turns)
    reward: float
    #: the episode ended with this step (the environment said done, or the turn budget
    #: or the context ran out: ``end_reason``)
    ended: bool = False
    #: "done", "max_turns" or "context" when ``ended``; "" while the episode goes on
    end_reason: str = ""
    #: observation tokens appended after the turn (a ``kind="observation"`` segment of
    #: the same append holds them)
    observation_tokens: int = 0
    #: the environment's details (short JSON values: why a call was refused, ...)
    info: dict[str, Any] = {}
    restart: int = 0


class SegmentFlush(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One durable flush of one group: its rows are in the data plane; the controller
    records it as a ``SegmentsRecorded`` event, or as one of the flushes an
    ``EpisodeTurnsRecorded`` carries (``docs/segments.md``). Generators hand it over as is."""

    kind: SegmentKind = "model"
    #: the version that sampled every token of it (None for observation tokens)
    weight_version: int | None = None
    #: one per sample with new tokens
    segments: list[Segment]
