"""Start a command as a terminal starts its foreground job: SIGINT at its default action.

A process inherits ignored signals: a non-interactive shell's background job (``cmd &``),
``nohup`` and some CI runners start their children with SIGINT ignored, and Python keeps
an inherited ``SIG_IGN`` (it installs its KeyboardInterrupt handler only over the default
action), as every POSIX program does. A test that sends SIGINT to stand for Ctrl-C must
not let its command inherit that: under ``pytest &`` the run never saw the signal and
trained to the end (exit 0), which read as a chance failure.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def _default_sigint() -> None:  # runs in the child, between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_foreground(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` whose child starts with SIGINT's default action."""
    return subprocess.Popen(argv, preexec_fn=_default_sigint, **kwargs)
