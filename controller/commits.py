"""Finished groups' commits, and what happens to one the log refuses.

A commit carries what a generator returned (rewards, lengths, payload keys, versions).
The log writer checks it against the state before it is written
(``controller.core.prefold``); one that breaks a rule -- a length that disagrees with
the group's recorded segments, an episode that has not ended -- is not written: its
group's attempt fails as its worker's failure (the caller's ``on_refused``), and the
batch's other commits are appended without it.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.core.prefold import RejectedFact
from controller.core.segments import segment_keys
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.partial import PartialRecorder
from events import schema as ev
from workers.api import GenerationOutcome, GenerationRequest

#: told (group id, why) when the log refuses that group's commit
OnRefused = Callable[[str, RejectedFact], None]


def commit_events(journal: Journal, reqs: list[GenerationRequest],
                  outs: list[GenerationOutcome], runs: bool = False) -> list[ev.GroupCommitted]:
    """The commits of finished groups (``outs[i]`` answers ``reqs[i]``).

    ``runs`` (partial rollouts): a group whose tokens span refits carries each sample's
    ``version_runs``, since a refit closes a segment without a flush and the tokens after
    the last recorded one need not all have the newest version (``docs/segments.md``).
    An episode's runs (observation tokens at -1) are left out: its turns flush anyway.
    """
    return [
        journal.make(
            ev.GroupCommitted,
            event_id=ev.group_event_id(req.group_id, "committed", req.attempt),
            group_id=req.group_id,
            attempt=req.attempt,
            weight_version_start=out.weight_version_start,
            weight_version_end=out.weight_version_end,
            payload_keys=list(out.payload_keys),
            rewards=list(out.rewards),
            lengths=list(out.lengths),
            version_runs=_spanning_runs(out) if runs else [],
        )
        for req, out in zip(reqs, outs)
    ]


def _spanning_runs(out: GenerationOutcome) -> list[list[int]]:
    if out.weight_version_start == out.weight_version_end or not out.version_runs:
        return []
    if any(v < 0 for r in out.version_runs for v in r[0::2]):
        return []
    return [list(r) for r in out.version_runs]


async def append_commits(journal: Journal, commits: list[ev.GroupCommitted],
                         on_refused: OnRefused) -> set[str]:
    """Append ``commits`` in one append, less those the log refuses (each goes to
    ``on_refused``; one more try per refusal). Returns the groups refused."""
    refused: set[str] = set()
    while commits:
        try:
            await journal.append(*commits)
            break
        except RejectedFact as err:
            gid = commits[err.index].group_id
            refused.add(gid)
            commits = [c for c in commits if c.group_id != gid]
            on_refused(gid, err)
    return refused


class PendingCommits:
    """Returned calls' groups waiting for their shared commit append (partial rollouts
    off: with them on, commits ride with the pauses' append, ``PartialRecorder.join``)."""

    def __init__(self, journal: Journal, rows: PartialRecorder) -> None:
        self.journal, self.rows = journal, rows
        self._pending: list[tuple[list[GenerationRequest], list[GenerationOutcome], OnRefused]] = []

    def add(self, reqs: list[GenerationRequest], outs: list[GenerationOutcome],
            on_refused: OnRefused) -> bool:
        """Queue a call's commits; True for the first since the last flush (the caller
        schedules :meth:`flush` then)."""
        self._pending.append((reqs, outs, on_refused))
        return len(self._pending) == 1

    async def flush(self, on_error: Callable[[BaseException], None]) -> None:
        """Commit what is queued in one append (the facts after the side effect), and
        delete the committed groups' segment rows; ``on_error`` hears if it fails."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        reqs = [req for rs, _, _ in pending for req in rs]
        routes = {r.group_id: refused for rs, _, refused in pending for r in rs}
        try:
            for req in reqs:
                crash_point("before_group_committed", req.group_id)
            inflight = self.journal.state.inflight
            rows = {r.group_id: segment_keys(inflight, [r.group_id]) for r in reqs}
            commits = commit_events(self.journal, reqs, [out for _, outs, _ in pending for out in outs])
            refused = await append_commits(self.journal, commits, lambda gid, err: routes[gid](gid, err))
        except Exception as err:  # fenced, or the store is gone: stop the run
            on_error(err)
            return
        self.rows.drop([key for gid, keys in rows.items() if gid not in refused for key in keys])
