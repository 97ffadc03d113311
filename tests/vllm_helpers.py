"""Shared pieces of the vLLM tests: the skip rule, a refit source, process counting."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from workers.backends import package_available


def vllm_skip_reason() -> str | None:
    """None when vLLM can run here; otherwise why the vLLM tests are skipped."""
    if not package_available("vllm"):
        return "vLLM is not installed (bash scripts/setup.sh --vllm installs the CPU build)"
    from workers.generator.vllm_backend import vllm_is_cpu_build

    if not (torch.cuda.is_available() or vllm_is_cpu_build()):
        return "this vLLM build needs a CUDA GPU and none is visible"
    return None


def refit_source(model):
    """The trainer's refit side (``RefitSource``, as ``TrainerWorker`` uses) over ``model``."""
    from workers.weight_sync import cpu_state_dict
    from workers.weight_transport import RefitSource

    return RefitSource(lambda: cpu_state_dict(model))


def processes_with_env(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (inherited by children)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:  # a zombie holds nothing
                    found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def child_pids() -> set[int]:
    """Live descendants of this process, but Python's multiprocessing resource tracker.

    The tracker is the interpreter's own helper, started once by the first spawned
    child and kept until the interpreter exits; it is not an engine process.
    """
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != "zombie" and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out
