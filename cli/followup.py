"""Follow-up commands printed for people, written so they can be pasted as they are.

The executable is the one that is running (``.venv/bin/rl-controller`` when started
that way, ``rl-controller`` when found on PATH); ``--data-dir`` is repeated when it is
not the default; ``--redis-url`` when it was given on the command line (the password
replaced by ``***``: paste yours in, or export ``RLC_REDIS_URL`` instead), and so are
``--redis-sentinel`` / ``--redis-master``; a command
that resumes a run repeats ``--ray-address`` / ``--local-workers`` (``worker_flags``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from cli.common import DEFAULT_DATA_DIR, ENV_MASTER, ENV_REDIS_URL, ENV_SENTINEL
from events.redis_store import redact_url


def executable() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "rl-controller":
        found = shutil.which("rl-controller")
        if found and os.path.realpath(found) == os.path.realpath(argv0):
            return "rl-controller"
        return argv0
    return f"{shlex.quote(sys.executable)} -m cli.main"


def store_flags(args: argparse.Namespace) -> str:
    """The flags that point another command at the same log."""
    flags = []
    url = getattr(args, "redis_url", "") or ""
    if url and url != os.environ.get(ENV_REDIS_URL, ""):
        flags.append(f"--redis-url {shlex.quote(redact_url(url))}")
    # Sentinels too (passwords come from the environment only): without them the
    # command looked for the run in the embedded default store, "no run ... in this store"
    for flag, attr, env in (("--redis-sentinel", "redis_sentinel", ENV_SENTINEL),
                            ("--redis-master", "redis_master", ENV_MASTER)):
        value = getattr(args, attr, "") or ""
        if value and value != os.environ.get(env, ""):
            flags.append(f"{flag} {shlex.quote(value)}")
    # With --redis-url too: the run directory (spill, checkpoints) is under --data-dir,
    # and a resume that looked in the default one found no spill and evicted the
    # buffered groups as "payload lost".
    data_dir = getattr(args, "data_dir", DEFAULT_DATA_DIR)
    if os.path.normpath(data_dir) != os.path.normpath(DEFAULT_DATA_DIR):
        flags.append(f"--data-dir {shlex.quote(data_dir)}")
    return " ".join(flags)


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``run`` that say where its workers ran, for a command that resumes it."""
    flags = []
    if getattr(args, "ray_address", None):
        flags += ["--ray-address", args.ray_address]
    if getattr(args, "local_workers", False):
        flags.append("--local-workers")
    return flags


def command(args: argparse.Namespace, *words: str) -> str:
    """``rl-controller WORDS... [store flags]``, ready to paste."""
    tail = store_flags(args)
    return " ".join([executable(), *(shlex.quote(w) for w in words), *([tail] if tail else [])])
