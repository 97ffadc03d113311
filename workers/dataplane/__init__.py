"""The data plane: sample payloads between generators and the trainer.

``make_dataplane(section, runtime)`` builds the configured implementation. The
production kind (``"transferqueue"``) never falls back to memory: if TransferQueue
cannot start, :class:`DataPlaneUnavailable` is raised.

The names below are imported on first use, so that importing ``config`` (which the
controller's ``Config`` composes) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.lazy import lazy_exports

from workers.dataplane.config import DataPlaneKind, DataPlaneRuntime, DataPlaneSection

if TYPE_CHECKING:
    from workers.dataplane.api import (
        DataPlane,
        DataPlaneError,
        DataPlaneUnavailable,
        DurableDataPlane,
        MissingPayloadError,
        Row,
        Tags,
    )
    from workers.dataplane.memory import MemoryDataPlane
    from workers.dataplane.spill import SpillDataPlane, SpillReader

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "DataPlane": "workers.dataplane.api",
    "DataPlaneError": "workers.dataplane.api",
    "DataPlaneUnavailable": "workers.dataplane.api",
    "DurableDataPlane": "workers.dataplane.api",
    "MemoryDataPlane": "workers.dataplane.memory",
    "MissingPayloadError": "workers.dataplane.api",
    "Row": "workers.dataplane.api",
    "SpillDataPlane": "workers.dataplane.spill",
    "SpillReader": "workers.dataplane.spill",
    "Tags": "workers.dataplane.api",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


def preload(kind: DataPlaneKind) -> None:
    """Import the implementation of ``kind`` now (TransferQueue's import takes seconds),
    e.g. on a thread while something else waits; ``make_dataplane`` then finds it loaded."""
    if kind == "transferqueue":
        from workers.dataplane import transferqueue

        transferqueue.preload()


def make_dataplane(config: DataPlaneSection, runtime: DataPlaneRuntime) -> "DataPlane":
    """Build the ``[dataplane]`` of the run ``runtime`` describes (wrapped in the durable
    spill under its run directory if ``dataplane.spill``)."""
    from workers.dataplane.memory import MemoryDataPlane
    from workers.dataplane.spill import SpillDataPlane

    spill_dir = runtime.spill_dir(config)  # before anything starts: it may refuse
    plane: DataPlane
    if config.kind == "memory":
        plane = MemoryDataPlane()
    else:
        # Imported here so that only runs that ask for TransferQueue import it.
        from workers.dataplane.transferqueue import TransferQueueDataPlane

        plane = TransferQueueDataPlane(config, runtime)
    if spill_dir is not None:
        plane = SpillDataPlane(plane, spill_dir)
    return plane


__all__ = sorted([*_EXPORTS, "DataPlaneKind", "DataPlaneRuntime", "DataPlaneSection", "make_dataplane", "preload"])
