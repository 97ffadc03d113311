"""Typed errors of the event layer. Each names the run and position it is about."""

from __future__ import annotations


class EventStoreError(Exception):
    """Base of every error raised by an EventStore or the codec."""


class EventDecodeError(EventStoreError):
    """An entry in the log could not be decoded into a known event."""

    def __init__(self, position: int | None, reason: str) -> None:
        self.position = position
        self.reason = reason
        where = "event" if position is None else f"event at position {position}"
        super().__init__(f"cannot decode {where}: {reason}")


class StreamIdError(EventDecodeError):
    """A stream entry whose id is not ``0-N`` (added by hand, e.g. ``XADD ... 5-124``).

    Its id sorts after every position, so the store can append nothing after it (XADD's
    ids only grow), and a read from any position returns it again: a follower stops.
    """


class FencedError(EventStoreError):
    """The writer's epoch is older than the run's current epoch: a newer controller owns the run."""

    def __init__(self, run_id: str, epoch: int, current_epoch: int) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.current_epoch = current_epoch
        super().__init__(
            f"run {run_id!r}: writer epoch {epoch} is fenced by epoch {current_epoch}; "
            "another controller has taken over this run"
        )


class ConcurrencyError(EventStoreError):
    """The log moved past the expected position with different events."""

    def __init__(self, run_id: str, expected: int, actual: int, detail: str = "") -> None:
        self.run_id = run_id
        self.expected = expected
        self.actual = actual
        msg = f"run {run_id!r}: expected log position {expected}, log is at {actual}"
        super().__init__(f"{msg}; {detail}" if detail else msg)


class RunNotFoundError(EventStoreError):
    """No log exists for the run id; ``known`` lists the runs that do exist."""

    def __init__(self, run_id: str, known: list[str]) -> None:
        self.run_id = run_id
        self.known = known
        listing = ", ".join(known) if known else "none"
        super().__init__(f"no run {run_id!r} in this store (runs: {listing})")


class StoreUnavailableError(EventStoreError):
    """The backing store cannot be reached or refused us (auth, TLS, network)."""


class StoreUrlError(EventStoreError):
    """A Redis URL that cannot be used as given (scheme, port or database)."""


class StorePermissionError(StoreUnavailableError):
    """The store refused a command this user may not run (a read-only Redis user, say).

    ``refused`` says what the server refused; ``hint`` what to do about it. The store
    cannot know which command of rl-controller it serves, so its hint is general; the
    command line names what that command needs (``with_hint``)."""

    def __init__(self, refused: str,
                 hint: str = "docs/security.md says which user each command needs") -> None:
        super().__init__(refused, hint)  # both in args: the error pickles as it is
        self.refused = refused
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.refused} (this Redis user may not do that; {self.hint})"

    def with_hint(self, hint: str) -> StorePermissionError:
        return StorePermissionError(self.refused, hint)


class RunIdError(EventStoreError, ValueError):
    """A run id the store cannot hold (whitespace, braces, empty or too long)."""


class StoreDataError(EventStoreError):
    """A run's key holds what rl-controller never writes there (a meta or snapshot field
    that is not a whole number, a key of another Redis type): it was changed by hand."""


class EpochNotClaimedError(EventStoreError):
    """The writer's epoch is newer than any claimed for the run: it never called claim_epoch."""

    def __init__(self, run_id: str, epoch: int, current_epoch: int) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.current_epoch = current_epoch
        super().__init__(
            f"run {run_id!r}: writer epoch {epoch} was never claimed "
            f"(current epoch {current_epoch}); call claim_epoch first"
        )


class RedisServerNotFoundError(StoreUnavailableError):
    """No ``redis-server`` binary to start the embedded store with."""


class ReplicationTimeoutError(StoreUnavailableError):
    """An append reached the primary but fewer than ``store.replicas`` replicas confirmed it.

    Its outcome is in doubt (the primary holds it; a failover may lose it): retrying the
    same batch at the same position resolves it, because a replayed batch is recognised
    by its event ids. Never treated as a success.
    """

    def __init__(
        self, where: str, confirmed: int, wanted: int, timeout_s: float,
        connected: int | None = None,
    ) -> None:
        self.confirmed = confirmed
        self.wanted = wanted
        #: the server's connected replicas when the wait ran out (None: it did not say)
        self.connected = connected
        if connected is None:
            why = ""
        elif connected < wanted:  # a replica dropped away: no wait can be long enough
            why = (f": the server has {_replicas(connected)} "
                   f"(store.replicas = {wanted} wants {wanted})")
        else:
            why = f": the server has {_replicas(connected)}, which did not confirm in time"
        super().__init__(
            f"Redis at {where}: only {confirmed} of {wanted} replicas confirmed the append "
            f"within {timeout_s:g}s{why}; its outcome is in doubt (the retry resolves it)"
        )


class ReplicasMissingError(StoreUnavailableError):
    """``store.replicas`` wants more replicas than are connected to the log's server.

    Every append would wait for confirmations that cannot come, so the store refuses at
    start (``EventStore.require_replicas``), before anything is written.
    """

    def __init__(self, where: str, wanted: int, connected: int) -> None:
        self.wanted = wanted
        self.connected = connected
        super().__init__(
            f"store.replicas = {wanted} makes every append wait for {_replicas(wanted)}, "
            f"but {where} has {_replicas(connected)}; connect replicas to it (replicaof) "
            f"or lower store.replicas"
        )


def _replicas(n: int) -> str:
    return f"{n} connected replica{'' if n == 1 else 's'}"


class ChainError(EventStoreError):
    """The log's hash chain does not hold: an entry, the head or a snapshot was altered."""

    def __init__(self, run_id: str, position: int | None, reason: str) -> None:
        self.run_id = run_id
        self.position = position
        self.reason = reason
        where = "" if position is None else f" at position {position}"
        super().__init__(f"run {run_id!r}: hash chain broken{where}: {reason}")
