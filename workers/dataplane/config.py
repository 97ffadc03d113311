"""Which data plane a run uses: ``[dataplane]`` as the user writes it, which
``make_dataplane`` takes as it is, and the run's ``DataPlaneRuntime`` beside it (run
directory, Ray cluster). No torch import, so loading a config stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import msgspec

from events.config_checks import non_negative, one_of, positive

DataPlaneKind = Literal["memory", "transferqueue"]


class DataPlaneSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[dataplane]``: where sample payloads live between generators and the trainer."""

    kind: DataPlaneKind = "transferqueue"
    """transferqueue in production; memory for tests and single-process runs."""
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
        one_of("dataplane.kind", self.kind, get_args(DataPlaneKind))
        positive("dataplane", self, "start_timeout_s")
        non_negative("dataplane", self, "storage_units")

    def units(self, ray_address: str) -> int:
        """The storage units a run starts on the Ray at ``ray_address`` (empty: local)."""
        return self.storage_units or (2 if ray_address else 1)


@dataclass(frozen=True)
class DataPlaneRuntime:
    """Where this run's data plane lives: the values the run decides, beside the user's
    ``[dataplane]`` table (``make_dataplane(section, runtime)``)."""

    #: the run's directory; the durable spill (``dataplane.spill``) goes under
    #: ``run_dir/spill``. None: no directory, so ``dataplane.spill`` must be off
    run_dir: str | None = None
    #: Ray address TransferQueue joins (empty: the initialised Ray, else a local one)
    ray_address: str = ""
    #: logical CPUs for a Ray started by the data plane (TransferQueue needs >= 4)
    ray_num_cpus: int = 4
    #: only join a data plane another process starts (waiting for it to be up), never
    #: start one: set for workers created while the controller starts it
    join: bool = False

    def spill_dir(self, section: DataPlaneSection) -> str | None:
        """The spill directory of ``section`` in this run (None: no spill)."""
        if not section.spill:
            return None
        if self.run_dir is None:
            raise ValueError("dataplane.spill = true needs the run's directory (or spill = false)")
        return str(Path(self.run_dir) / "spill")
