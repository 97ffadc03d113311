"""Named crash points at every write-ahead boundary -- a test hook, off by default.

``RLC_CRASH_AT=after_step_begun:3`` makes the controller process exit abruptly
(``os._exit``, no cleanup, no flush: as close to ``kill -9`` as a process can do to
itself) the moment it reaches ``after_step_begun`` with key 3. Without a key
(``RLC_CRASH_AT=before_group_committed``) the first hit crashes. Several points may be
given, comma separated. Chaos tests use this to stop the controller between an intent
and its side effect, and between a side effect and its fact.
"""

from __future__ import annotations

import os
import sys
from typing import Final

ENV_VAR: Final = "RLC_CRASH_AT"
EXIT_CODE: Final = 137

#: Every boundary the controller announces, in protocol order.
CRASH_POINTS: Final = (
    "after_run_started",
    "after_rollout_admitted",
    "before_group_committed",
    "after_group_committed",
    "after_step_begun",
    "after_begin_train_step",
    "before_microbatch_trained",
    "after_microbatch_trained",
    "before_step_finished",
    "after_step_finished",
    "before_weights_published",
    "after_weights_published",
    "before_checkpoint_saved",
    "after_checkpoint_saved",
    "before_payloads_released",
    "after_payloads_released",
)


def _parse(spec: str) -> dict[str, str | None]:
    armed: dict[str, str | None] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, key = item.partition(":")
        if name not in CRASH_POINTS:
            raise ValueError(
                f"{ENV_VAR}: unknown crash point {name!r}; known: {', '.join(CRASH_POINTS)}"
            )
        armed[name] = key or None
    return armed


_armed: dict[str, str | None] = _parse(os.environ.get(ENV_VAR, ""))


def rearm(spec: str) -> None:
    """Re-read the spec (tests that arm crash points in-process)."""
    global _armed
    _armed = _parse(spec)


def crash_point(name: str, key: object = None) -> None:
    """Exit the process abruptly if ``name`` (with ``key``) is armed."""
    if not _armed:
        return
    if name not in _armed:
        if name not in CRASH_POINTS:
            raise ValueError(f"crash_point({name!r}) is not a declared crash point")
        return
    want = _armed[name]
    if want is None or want == str(key):
        sys.stderr.write(f"[rl-controller] crash point {name}:{key} reached; exiting\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
