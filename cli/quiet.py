"""Keeping third-party chatter out of the user's terminal.

Ray, TransferQueue, megatron-core and friends log warnings to stderr (Ray's token
notice on every run; TransferQueue's thread-count warning on every put and get; library
deprecation warnings). A run's terminal is for the progress display and errors; these
go to ``third_party.log`` in the run directory instead.

Also sizes TransferQueue's torch threads to the machine: it defaults to 8 and warns,
each call, when the machine has fewer physical cores.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

#: loggers whose console handlers are replaced by the run's file
THIRD_PARTY = ("ray", "transfer_queue", "megatron", "torch", "transformers", "urllib3", "filelock")

_handler: logging.Handler | None = None


def physical_cores() -> int:
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:
        return max(1, os.cpu_count() or 1)


def size_transferqueue_threads() -> None:
    """``TQ_NUM_THREADS`` for this process and the workers of a Ray it starts (before
    ``transfer_queue`` is imported: it reads the variable once)."""
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, physical_cores())))


def route_to_file(log_file: Path) -> None:
    """Send Python warnings and third-party log records to ``log_file``, not the console.

    Safe to call again after a library (re)configures its loggers (``ray.init`` does).
    """
    global _handler
    if _handler is None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        _handler = logging.FileHandler(log_file)
        _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.captureWarnings(True)  # the default filters stay (ResourceWarning ignored)
        root = logging.getLogger()
        root.addHandler(_handler)
        if root.level > logging.WARNING or root.level == logging.NOTSET:
            root.setLevel(logging.WARNING)
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] in THIRD_PARTY]
    for name in [*THIRD_PARTY, *names, "py.warnings"]:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        if not logger.propagate and _handler not in logger.handlers:
            logger.addHandler(_handler)
