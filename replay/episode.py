"""One episode of a run, turn by turn, as its log recorded it (``replay --episode``).

The log says everything about an episode except its token ids: which attempt sampled
each model turn and at which weight version (``SegmentsRecorded``), what each env call
asked (``EnvStepsRequested``) and what it returned (``EnvStepsCompleted``), which
restarts dropped the episode's earlier turns (``EpisodesRestarted``), which lost rows
dropped its recorded tokens (``SegmentsDropped``), and the attempt
that committed the group (``GroupCommitted``). The ids come from the data plane when it
still holds them: the committed row (its completion, cut at the recorded segment
offsets) or, before the commit, the segment rows themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from controller.core.turns import expanded
from events import schema as ev
from workers.dataplane.api import MissingPayloadError


class RowSource(Protocol):
    """``workers.dataplane.api.DataPlane.get``, all this module needs of it."""

    def get(self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None) -> list[Any]: ...


@dataclass
class Piece:
    """One recorded segment of the episode: a model turn's tokens or an observation's."""

    kind: str
    start: int
    length: int
    key: str
    attempt: int
    weight_version: int | None
    ids: list[int] | None = None


@dataclass
class TurnView:
    turn: int
    pieces: list[Piece] = field(default_factory=list)
    #: the env call that answered the turn: its request fingerprint and the attempt
    #: that wrote its intent (None: the turn was never answered)
    request: str | None = None
    requested_by: int | None = None
    #: later attempts that re-issued the call with the same key (a deduplicating env
    #: answers them from its record: the result may come from any of them)
    reissued_by: list[int] = field(default_factory=list)
    reward: float | None = None
    ended: bool = False
    end_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpisodeView:
    run_id: str
    group_id: str
    sample: int
    restart: int = 0
    restarts: list[str] = field(default_factory=list)
    attempts: int = 0
    committed_by: int | None = None
    reward: float | None = None
    prompt_ids: list[int] | None = None
    turns: dict[int, TurnView] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["turns"] = [asdict(t) for _, t in sorted(self.turns.items())]
        return out


class EpisodeNotFound(ValueError):
    """The log has no such episode (one line for the user)."""


def episode_view(run_id: str, events: Iterable[ev.Event], group_id: str, sample: int) -> EpisodeView:
    """The episode (``group_id``, ``sample``) folded from the run's events."""
    view, n_samples, episodic = EpisodeView(run_id, group_id, sample), 0, False
    for e in expanded(events):
        if getattr(e, "group_id", None) != group_id:
            continue
        if isinstance(e, ev.RolloutAdmitted):
            view.attempts, n_samples = e.attempt, e.n_samples
        elif isinstance(e, ev.SegmentsRecorded):
            episodic = episodic or any(s.turn > 0 for s in e.segments)
            for s in e.segments:
                if s.sample == sample:
                    view.turns.setdefault(s.turn, TurnView(s.turn)).pieces.append(Piece(
                        e.kind, s.start, s.length, s.key, e.attempt, e.weight_version))
        elif isinstance(e, (ev.EnvStepsRequested, ev.EnvStepsCompleted)):
            episodic = True
            _env_event(view, e)
        elif isinstance(e, ev.SegmentsDropped):
            _segments_dropped(view, e)
        elif isinstance(e, ev.EpisodesRestarted) and sample in e.samples:
            view.restart += 1
            view.restarts.append(f"after attempt {e.attempt}: {e.reason}")
            view.turns.clear()  # the restart dropped them: the episode begins again
        elif isinstance(e, ev.GroupCommitted) and sample < len(e.rewards):
            view.committed_by, view.reward = e.attempt, e.rewards[sample]
    if n_samples == 0:
        raise EpisodeNotFound(f"group {group_id!r} was never admitted in run {run_id!r}")
    if not 0 <= sample < n_samples:
        raise EpisodeNotFound(f"group {group_id!r} has samples 0..{n_samples - 1}, not {sample}")
    if not episodic:
        raise EpisodeNotFound(
            f"group {group_id!r} has no episode records: its task is not multi-turn, or "
            "partial rollouts (rollout.partial.enabled), which record episodes, were off")
    return view


def _segments_dropped(view: EpisodeView, e: ev.SegmentsDropped) -> None:
    """A lost row costs its sample every recorded segment (they are sampled again from
    the prompt, ``docs/segments.md``); a sample that had made calls begins its episode
    again, as the fold restarts it (``reducer_groups._on_segments_dropped``)."""
    lost = set(e.keys)
    if any(p.key in lost for t in view.turns.values() for p in t.pieces):
        called = any(t.request is not None for t in view.turns.values())
        for t in view.turns.values():
            t.pieces.clear()
        why = f"after attempt {e.attempt}: its segments were dropped ({e.reason})"
        if called:
            view.restart += 1
            view.turns.clear()
            why += "; its episode begins again"
        view.restarts.append(why)


def _env_event(view: EpisodeView, e: ev.EnvStepsRequested | ev.EnvStepsCompleted) -> None:
    if isinstance(e, ev.EnvStepsRequested):
        for c in e.calls:
            if c.sample == view.sample and c.restart == view.restart:
                t = view.turns.setdefault(c.turn, TurnView(c.turn))
                if t.request is None:
                    t.request, t.requested_by = c.request, e.attempt
                else:  # a re-issue repeats the first intent's request and key
                    t.reissued_by.append(e.attempt)
        return
    for r in e.results:
        if r.sample == view.sample and r.restart == view.restart:
            t = view.turns.setdefault(r.turn, TurnView(r.turn))
            t.reward, t.ended, t.end_reason, t.info = r.reward, r.ended, r.end_reason, dict(r.info)


def fill_ids(view: EpisodeView, plane: RowSource, committed_key: str | None) -> bool:
    """Put the token ids into ``view`` from the data plane; False if it has none of them."""
    pieces = [p for t in view.turns.values() for p in t.pieces]
    if committed_key is not None:
        try:
            (row,) = plane.get(view.run_id, [committed_key], ["input_ids", "prompt_len"])
        except MissingPayloadError:  # released, or never spilled: try the segment rows
            row = None
        if row is not None:
            ids, prompt_len = row["input_ids"].tolist(), int(row["prompt_len"])
            view.prompt_ids, completion = ids[:prompt_len], ids[prompt_len:]
            for p in pieces:
                p.ids = completion[p.start:p.start + p.length]
            return True
    found = False
    for p in pieces:
        try:
            (row,) = plane.get(view.run_id, [p.key], ["tokens"])
        except MissingPayloadError:  # deleted once the group committed (scratch then)
            continue
        p.ids, found = row["tokens"].tolist(), True
    return found


def render_episode(view: EpisodeView) -> list[str]:
    """The text of ``replay --episode``: one block per turn."""
    state = (f"committed by attempt {view.committed_by}, return {view.reward:.4f}"
             if view.committed_by is not None else f"not committed ({view.attempts} attempts)")
    lines = [f"episode {view.run_id}/{view.group_id}/s{view.sample}: {state}"]
    lines += [f"  restarted {r}" for r in view.restarts]
    if view.prompt_ids is not None:
        lines.append(f"  prompt  {len(view.prompt_ids)} tokens {view.prompt_ids}")
    for n, t in sorted(view.turns.items()):
        for p in t.pieces:
            ids = "" if p.ids is None else f" {p.ids}"
            if p.kind == "model":
                lines.append(f"  turn {n:<3} model        {p.length:>4} tokens, attempt {p.attempt}, "
                             f"weights v{p.weight_version}{ids}")
            else:
                lines.append(f"  turn {n:<3} observation  {p.length:>4} tokens{ids}")
        if t.request is not None:
            got = ("no result recorded" if t.reward is None else
                   f"reward {t.reward:.4f}" + (f", ended ({t.end_reason})" if t.ended else ""))
            info = f" {t.info}" if t.info else ""
            again = f".r{view.restart}" if view.restart else ""  # as workers.envs.base.StepKey
            by = f"attempt {t.requested_by}" + "".join(f", re-issued by {a}" for a in t.reissued_by)
            lines.append(f"  turn {n:<3} env call     {view.run_id}/{view.group_id}/s{view.sample}"
                         f"{again}/t{n} request {t.request}, {by}: {got}{info}")
    return lines
