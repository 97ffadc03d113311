"""The Ctrl-C tests' commands see SIGINT even when pytest itself runs with it ignored."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.foreground import popen_foreground

SHOW = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"


def test_a_command_started_under_an_ignored_sigint_still_gets_keyboard_interrupt():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `pytest &` would start
    try:
        inherited = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True)
        proc = popen_foreground([sys.executable, "-c", SHOW], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inherited.stdout.strip() == "False"  # what a plain Popen passes on
    assert out.strip() == "True"
