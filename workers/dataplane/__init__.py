"""The data plane: sample payloads between generators and the trainer.

``make_dataplane(DataPlaneConfig(...))`` builds the configured implementation. The
production kind (``"transferqueue"``) never falls back to memory: if TransferQueue
cannot start, :class:`DataPlaneUnavailable` is raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workers.dataplane.api import (
    DataPlane,
    DataPlaneError,
    DataPlaneUnavailable,
    MissingPayloadError,
    Row,
    Tags,
)
from workers.dataplane.memory import MemoryDataPlane
from workers.dataplane.spill import SpillDataPlane

DataPlaneKind = Literal["memory", "transferqueue"]


@dataclass(frozen=True)
class DataPlaneConfig:
    """Which data plane a run uses."""

    #: "transferqueue" in production; "memory" for tests and single-process runs
    kind: DataPlaneKind = "transferqueue"
    #: directory for the durable spill (None: no spill; payloads die with the process)
    spill_dir: str | None = None
    #: Ray address TransferQueue joins (None: the initialised Ray, else a local one)
    ray_address: str | None = None
    #: logical CPUs for a Ray started by the data plane (TransferQueue needs >= 4)
    ray_num_cpus: int = 4
    #: TransferQueue SimpleStorage units
    num_storage_units: int = 2
    #: Ray resource a storage unit's node must offer (None: round-robin over all nodes)
    storage_node_resource: str | None = None
    #: seconds TransferQueue's own actors may take to start (when this process starts them)
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.kind not in ("memory", "transferqueue"):
            raise ValueError(
                f"DataPlaneConfig.kind must be 'memory' or 'transferqueue', got {self.kind!r}"
            )


def preload(kind: DataPlaneKind) -> None:
    """Import the implementation of ``kind`` now (TransferQueue's import takes seconds),
    e.g. on a thread while something else waits; ``make_dataplane`` then finds it loaded."""
    if kind == "transferqueue":
        from workers.dataplane import transferqueue

        transferqueue.preload()


def make_dataplane(config: DataPlaneConfig) -> DataPlane:
    """Build the configured data plane (wrapped in the durable spill if ``spill_dir``)."""
    plane: DataPlane
    if config.kind == "memory":
        plane = MemoryDataPlane()
    else:
        # Imported here so that only runs that ask for TransferQueue import it.
        from workers.dataplane.transferqueue import TransferQueueConfig, TransferQueueDataPlane

        plane = TransferQueueDataPlane(
            TransferQueueConfig(
                ray_address=config.ray_address,
                ray_num_cpus=config.ray_num_cpus,
                num_storage_units=config.num_storage_units,
                storage_node_resource=config.storage_node_resource,
                start_timeout_s=config.start_timeout_s,
            )
        )
    if config.spill_dir is not None:
        plane = SpillDataPlane(plane, config.spill_dir)
    return plane


__all__ = [
    "DataPlane",
    "DataPlaneConfig",
    "DataPlaneError",
    "DataPlaneKind",
    "DataPlaneUnavailable",
    "MemoryDataPlane",
    "MissingPayloadError",
    "Row",
    "SpillDataPlane",
    "Tags",
    "make_dataplane",
    "preload",
]
