"""Which data plane a run uses: ``[dataplane]`` as the user writes it, and the
``DataPlaneConfig`` that ``make_dataplane`` builds from. No torch import, so loading
a config stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from events.config_checks import non_negative, positive

DataPlaneKind = Literal["memory", "transferqueue"]


@dataclass(frozen=True)
class DataPlaneConfig:
    """Which data plane a run uses, and where it runs: what ``make_dataplane`` and the
    TransferQueue adapter are built from (``DataPlaneSection.dataplane_config`` places
    the user's table under a run directory and on a Ray cluster)."""

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
    #: only join a data plane another process starts (waiting for it to be up), never
    #: start one: set for workers created while the controller starts it
    join: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("memory", "transferqueue"):
            raise ValueError(
                f"DataPlaneConfig.kind must be 'memory' or 'transferqueue', got {self.kind!r}"
            )


class DataPlaneSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[dataplane]``: where sample payloads live between generators and the trainer."""

    kind: Literal["transferqueue", "memory"] = "transferqueue"
    spill: bool = True
    """Write payloads through to disk (memory-mapped TensorDicts) to survive a restart."""
    storage_node_resource: str = ""
    """TransferQueue storage units only on nodes offering this Ray resource; empty =
    round-robin over every node. A unit dies with its node and TransferQueue keeps no
    copy, so keep them off nodes you expect to lose (e.g. preemptible generators)."""
    storage_units: int = 0
    """TransferQueue storage units (Ray actors holding payloads; one CPU each). 0 (the
    default): one on a local Ray -- the embedded default, where each unit is one more
    process importing torch at start-up -- and two when joining a cluster
    (``ray.address``), where they spread over the nodes (one unit moved 0.64x the
    rows/s of two in bench_dataplane.py)."""
    start_timeout_s: float = 120.0
    """How long TransferQueue's controller and storage units may take to be placed and
    answer when the run starts them; past it the run stops and says which are pending."""

    def __post_init__(self) -> None:
        positive("dataplane", self, "start_timeout_s")
        non_negative("dataplane", self, "storage_units")

    def units(self, ray_address: str) -> int:
        """The storage units a run starts on the Ray at ``ray_address`` (empty: local)."""
        return self.storage_units or (2 if ray_address else 1)

    def dataplane_config(
        self, *, run_dir: str | Path, ray_address: str, ray_num_cpus: int
    ) -> DataPlaneConfig:
        """The data plane of the run in ``run_dir`` (its spill under ``run_dir/spill``),
        on the Ray cluster at ``ray_address`` (empty: the initialised or a local one)."""
        return DataPlaneConfig(
            kind=self.kind,
            spill_dir=str(Path(run_dir) / "spill") if self.spill else None,
            ray_address=ray_address or None,
            ray_num_cpus=ray_num_cpus,
            storage_node_resource=self.storage_node_resource or None,
            num_storage_units=self.units(ray_address),
            start_timeout_s=self.start_timeout_s,
        )
