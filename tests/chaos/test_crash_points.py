"""Kill -9 the controller at every named crash point, restart, continue to N steps.

Every scenario runs real controller processes (``rl-controller run`` in a forked
child, in-process workers, memory data plane + durable spill, a real redis-server):
the process exits with 137 at the armed point -- no cleanup, no flush -- and a
``--resume`` brings the run to N steps. ``Chaos.check`` then proves, from the log
and the workers' artefacts, that no acknowledged event was lost, every invariant
holds (``rl-controller audit`` exits 0), every committed group is accounted for, and
``replay --retrain --verify`` of the log reproduces the final weights.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from controller.crashpoints import CRASH_POINTS
from tests.chaos.harness import EXIT_CRASH, Chaos
from tests.chaos.test_episode_crashes import POINTS as EPISODE_POINTS
from tests.chaos.test_partial_crashes import PARTIAL_SCENARIOS
from workers.dataplane.memory import MemoryDataPlane
from workers.dataplane.spill import SpillDataPlane

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(300)]

N = 4
UNTIL_CHECKPOINT = ["--set", "checkpoint.retain_payloads=until_checkpoint"]

#: (crash spec for the first run, extra run args): the first run dies there, a resume
#: finishes. Keys: group ids g000000.., steps 0..3 (versions 1..4), versions.
FIRST_RUN = {
    "after_run_started": ("after_run_started", []),
    "after_rollout_admitted": ("after_rollout_admitted:g000002", []),
    "before_group_committed": ("before_group_committed:g000001", []),
    "after_group_committed": ("after_group_committed:g000003", []),
    "after_step_begun": ("after_step_begun:1", []),
    "after_begin_train_step": ("after_begin_train_step:1", []),
    "before_microbatch_trained": ("before_microbatch_trained:2", []),
    "after_microbatch_trained": ("after_microbatch_trained:2", []),
    "before_step_finished": ("before_step_finished:0", []),
    "after_step_finished": ("after_step_finished:0", []),
    "after_step_finished_ckpt": ("after_step_finished:2", []),
    "before_weights_published": ("before_weights_published:1", []),
    "before_weights_published_initial": ("before_weights_published:0", []),
    "after_weights_published": ("after_weights_published:1", []),
    "before_checkpoint_saved": ("before_checkpoint_saved:2", []),
    "after_checkpoint_saved": ("after_checkpoint_saved:2", []),
    "before_payloads_released": ("before_payloads_released:2", UNTIL_CHECKPOINT),
    "after_payloads_released": ("after_payloads_released:2", UNTIL_CHECKPOINT),
    # a worker dies in the run (chaos hook), then the controller dies right after
    # the log recorded it
    "after_worker_lost": ("after_microbatch_trained:1@trainer,after_worker_lost", []),
    "after_step_aborted": ("after_microbatch_trained:1@trainer,after_step_aborted:1", []),
    "after_group_failed": (
        "after_rollout_admitted:g000003@generator-0,after_group_failed:g000003", []
    ),
}

#: generator calls carrying 3 groups: admissions and commits are one append per call,
#: a crash point fires for each of its groups (g000001 is the middle of the first call).
BATCHED = ["--set", "rollout.groups_per_call=3"]
FIRST_RUN.update({
    "batched_after_rollout_admitted": ("after_rollout_admitted:g000001", BATCHED),
    "batched_before_group_committed": ("before_group_committed:g000001", BATCHED),
    "batched_after_group_committed": ("after_group_committed:g000001", BATCHED),
    "batched_generator_lost": (
        "after_rollout_admitted:g000004@generator-0,after_group_failed:g000004", BATCHED
    ),
})

#: (first crash, crash of the first resume): recovery's own boundaries.
DURING_RECOVERY = {
    "after_controller_started": ("after_step_finished:2", "after_controller_started"),
    "after_log_repaired": ("after_microbatch_trained:2", "after_log_repaired"),
    "after_spill_reloaded": ("after_step_finished:2", "after_spill_reloaded"),
    "after_orphans_deleted": ("before_group_committed:g000003", "after_orphans_deleted"),
    "after_step_retrained": ("after_step_finished:2", "after_step_retrained:2"),
    "recovery_publish": ("after_step_finished:1", "before_weights_published:2"),
}


@pytest.mark.parametrize("name", sorted(FIRST_RUN))
def test_crash_in_first_run(chaos: Chaos, name: str) -> None:
    crash, extra = FIRST_RUN[name]
    chaos.run("r", steps=N, resume=False, crash=crash, args=extra, expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, expect=0)
    chaos.check("r", N)


@pytest.mark.parametrize("name", sorted(DURING_RECOVERY))
def test_crash_during_recovery(chaos: Chaos, name: str) -> None:
    first, second = DURING_RECOVERY[name]
    chaos.run("r", steps=N, resume=False, crash=first, expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, crash=second, expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, expect=0)
    chaos.check("r", N)


def test_orphan_rows_are_deleted(chaos: Chaos) -> None:
    """Rows a generator wrote before its GroupCommitted landed are gone after a restart."""
    chaos.run("r", steps=N, resume=False, crash="before_group_committed:g000003", expect=EXIT_CRASH)
    assert any("/g000003/" in k and "/a1/" in k for k in _spilled_keys(chaos, "r"))
    chaos.run("r", steps=N, resume=True, expect=0)
    state = chaos.check("r", N)["state"]
    keep = {k for g in state.groups.values() for k in g.payload_keys}
    for key in _spilled_keys(chaos, "r"):
        if "/g000003/" in key and "/a1/" in key:
            assert key in keep, key


def test_corrupt_checkpoint_is_rejected(chaos: Chaos) -> None:
    """A checkpoint whose files no longer match: CheckpointRejected, the older one is used."""
    chaos.run("r", steps=N, resume=False, crash="after_step_finished:3", expect=EXIT_CRASH)
    state = chaos.fold("r").state
    (ck,) = [c for c in state.checkpoints if c.trainer_version == 2]
    model = Path(ck.uri) / "model.pt"
    model.write_bytes(model.read_bytes()[:-7] + b"garbage")
    chaos.run("r", steps=N, resume=True, crash="after_checkpoint_rejected", expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, expect=0)
    state = chaos.check("r", N)["state"]
    assert [r.trainer_version for r in state.rejected_checkpoints] == [2]
    assert "sha256" in state.rejected_checkpoints[0].reason


def test_lost_buffered_payload_is_evicted(chaos: Chaos) -> None:
    """A committed, not yet trained group whose rows are gone: GroupEvicted, on the log."""
    chaos.run("r", steps=N, resume=False, crash="after_group_committed:g000003", expect=EXIT_CRASH)
    _wipe_group(chaos, "r", "g000003")
    chaos.run("r", steps=N, resume=True, crash="after_lost_payloads_evicted", expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, expect=0)
    state = chaos.check("r", N)["state"]
    assert state.groups["g000003"].evicted_reason.startswith("payload lost")


def test_lost_payloads_stop_then_rewind(chaos: Chaos) -> None:
    """Payloads needed to re-train are gone: stop with an explanation; rewind on request."""
    # The v2 checkpoint must be durable when the run dies at v3: saved in line (an async
    # save may still be writing it then, and the rewind would go back to v0).
    in_line = ["--set", "checkpoint.async_save=false"]
    chaos.run("r", steps=N, resume=False, crash="after_step_finished:2", args=in_line,
              expect=EXIT_CRASH)
    state = chaos.fold("r").state
    lost = state.steps[2].group_ids
    for gid in lost:
        _wipe_group(chaos, "r", gid)
    rc, out = _resume_output(chaos)
    assert rc == 5, out
    assert "--rewind-to-checkpoint" in out and "RunRewound" in out
    # the command to paste carries this run's store, data directory and workers (it
    # said 'rl-controller run --resume --run-id r --rewind-to-checkpoint': the default
    # store and data directory, where the run is not)
    (line,) = [x for x in out.splitlines() if x.startswith("rl-controller: error: recovery stopped")]
    said = shlex.split(line.rsplit("--rewind-to-checkpoint: ", 1)[-1])
    assert said[said.index("run"):] == ["run", "--resume", "--run-id", "r", "--steps", str(N), "--local-workers",
                        "--redis-url", chaos.redis_url, "--data-dir", str(chaos.root / "data"),
                        "--rewind-to-checkpoint"], line
    chaos.run("r", steps=N, resume=True, args=["--rewind-to-checkpoint"],
              crash="after_run_rewound", expect=EXIT_CRASH)
    chaos.run("r", steps=N, resume=True, expect=0)
    state = chaos.check("r", N)["state"]
    (rewind,) = state.rewinds
    assert (rewind.from_trainer_version, rewind.to_trainer_version) == (3, 2)
    assert rewind.lost_steps == [2] and sorted(rewind.lost_group_ids) == sorted(lost)
    rc, out = chaos.cli("audit", "--run", "r", "--json")
    assert rc == 0 and json.loads(out[out.index("{"):])["rewinds"], out


def test_every_crash_point_is_covered() -> None:
    """The tables above arm every declared crash point (guards new points)."""
    armed = set()
    for spec, _ in FIRST_RUN.values():
        armed |= {item.split("@")[0].split(":")[0] for item in spec.split(",")}
    for first, second in DURING_RECOVERY.values():
        armed |= {first.split(":")[0], second.split(":")[0]}
    armed |= {"after_checkpoint_rejected", "after_lost_payloads_evicted", "after_run_rewound"}
    for spec in PARTIAL_SCENARIOS.values():  # partial rollouts: tests.chaos.test_partial_crashes
        armed |= {item.split("@")[0].split(":")[0] for item in spec.split(",")}
    # episodes: tests.chaos.test_episode_crashes (its random kills draw POINTS; one test
    # crashes right after a recorded restart)
    armed |= set(EPISODE_POINTS) | {"after_episodes_restarted"}
    # eviction by the staleness window is timing-dependent: exercised by the soak
    missing = set(CRASH_POINTS) - armed - {"after_group_evicted"}
    assert not missing, f"crash points without a scenario: {sorted(missing)}"


def _spill(chaos: Chaos, run_id: str) -> SpillDataPlane:
    """The run's spill directory read through the spill itself (its on-disk format is its own)."""
    spill = SpillDataPlane(MemoryDataPlane(), chaos.run_dir(run_id) / "spill")
    spill.reload(run_id)
    return spill


def _spilled_keys(chaos: Chaos, run_id: str) -> list[str]:
    return _spill(chaos, run_id).list(run_id)


def _wipe_group(chaos: Chaos, run_id: str, group_id: str) -> None:
    """Lose a group's rows from disk, as a lost or wiped spill volume would."""
    spill = _spill(chaos, run_id)
    doomed = [k for k in spill.list(run_id) if f"/{group_id}/" in k]
    assert doomed, f"no spilled rows of {group_id}"
    spill.clear(run_id, doomed)
    assert not set(doomed) & set(_spilled_keys(chaos, run_id))


def _resume_output(chaos: Chaos) -> tuple[int, str]:
    proc = chaos.start("r", steps=N, resume=True)
    rc = chaos.finish(proc)
    return rc, proc.log.read_text()


def test_a_rewind_evicts_the_groups_of_the_weights_it_discards(chaos: Chaos) -> None:
    """Buffered groups sampled by a version the rewind discards are evicted with it.

    Seen in a real run rewound from v12 to v10: groups generated by v11 and v12 stayed
    in the buffer, the next step trained on them at lag -1, the log took a
    MicrobatchTrained its own fold refuses (audit: "lag -1 ... outside the window") and
    the run ended on "position 500 holds a different event id", exit 2. Here no
    checkpoint is written, so the rewind goes back to the initial weights."""
    no_checkpoints = ["--set", "checkpoint.every_steps=1000"]
    chaos.run("r", steps=N, resume=False, crash="after_group_committed:g000008",
              args=no_checkpoints, expect=EXIT_CRASH)
    state = chaos.fold("r").state
    newer = [g.group_id for g in state.iter_buffer() if g.weight_version_end >= 1]
    assert "g000008" in newer, [(g.group_id, g.weight_version_end) for g in state.iter_buffer()]
    for record in state.steps.values():
        for gid in record.group_ids:
            _wipe_group(chaos, "r", gid)
    chaos.run("r", steps=N, resume=True, args=["--rewind-to-checkpoint"], expect=0)
    state = chaos.check("r", N)["state"]
    (rewind,) = state.rewinds
    assert rewind.to_trainer_version == 0 and rewind.from_trainer_version >= 1
    for gid in newer:
        assert (state.groups[gid].evicted_reason or "").startswith("rewound"), gid
