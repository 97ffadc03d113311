"""``store.replicas``: an append returns only once N replicas hold it; a timeout is an error.

Real redis-server processes on loopback: a primary and a replica (``replicaof``).
The replica is frozen with SIGSTOP so that it cannot acknowledge a write, which is how a
lagging or partitioned replica looks to the primary's ``WAIT``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.errors import ReplicasMissingError, ReplicationTimeoutError, StoreUnavailableError
from events.redis_store import RedisEventStore, events_key
from events.store_config import StoreConfig
from events.schema import GroupFailed
from tests.sentinel_cluster import SentinelCluster

pytestmark = pytest.mark.integration

RUN = "replicated"


def failed(n: int, epoch: int) -> GroupFailed:
    return GroupFailed(event_id=f"group:g{n}:failed:a0", epoch=epoch, ts=float(n),
                       group_id=f"g{n}", attempt=0, reason="replication test")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[SentinelCluster]:
    """Primary and replica only (no sentinels)."""
    cluster = SentinelCluster(tmp_path, n_sentinels=0)
    cluster.primary.start()
    cluster.replica.start()
    cluster.wait_replica_in_sync(cluster.replica)
    try:
        yield cluster
    finally:
        cluster.stop()


def replica_len(cluster: SentinelCluster) -> int:
    return int(cluster.client(cluster.replica).xlen(events_key(RUN)))


def test_an_acknowledged_append_is_already_on_the_replica(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=1))
    epoch = store.claim_epoch(RUN)
    # WAIT covered the claim: the replica has the epoch before any append.
    assert int(pair.client(pair.replica).hget(f"rlc:{{{RUN}}}:meta", "epoch")) == epoch
    for n in range(1, 51):
        (pos,) = store.append(RUN, [failed(n, epoch)], expected_position=n - 1, epoch=epoch)
        # No sleep, no polling: the append's return is the proof.
        assert replica_len(pair) >= pos
    store.close()


def test_a_wait_timeout_is_an_error_and_the_retry_resolves_it(pair: SentinelCluster) -> None:
    cfg = StoreConfig(replicas=1, wait_timeout_s=0.3)
    store = RedisEventStore(pair.primary.url, replication=cfg)
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch)
    pair.pause(pair.replica)
    try:
        with pytest.raises(ReplicationTimeoutError, match="in doubt"):
            store.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
        # The primary holds it, unconfirmed: in doubt, not lost and not acknowledged.
        assert store.last_position(RUN) == 2
        # Still frozen, retried on a fresh connection that wrote nothing: WAIT there
        # would count the frozen replica at once, so the replay must write a barrier
        # and wait for it, and fail like the first attempt.
        fresh = RedisEventStore(pair.primary.url, replication=cfg)
        with pytest.raises(ReplicationTimeoutError):
            fresh.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
        fresh.close()
    finally:
        pair.resume(pair.replica)
    retry = RedisEventStore(pair.primary.url, replication=cfg)
    assert retry.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch) == [2]
    assert replica_len(pair) == 2
    assert [s.event.event_id for s in retry.read(RUN)] == [failed(n, epoch).event_id for n in (1, 2)]
    store.close()
    retry.close()


def test_more_replicas_than_exist_never_succeeds_silently(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=2, wait_timeout_s=0.2))
    with pytest.raises(ReplicationTimeoutError, match="of 2 replicas confirmed"):
        store.claim_epoch(RUN)
    store.close()


def test_the_store_refuses_more_replicas_than_the_server_has_before_writing(
    pair: SentinelCluster,
) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=1))
    store.require_replicas(1)  # the pair's one replica is connected
    with pytest.raises(ReplicasMissingError) as refused:
        store.require_replicas(2)
    assert str(refused.value).startswith("store.replicas = 2 ")
    assert f"127.0.0.1:{pair.primary.port}/0 has 1 connected replica;" in str(refused.value)
    assert pair.client(pair.primary).keys("*") == []  # asked, nothing written
    store.close()


def test_a_replica_that_drops_away_fails_the_append_naming_the_cause(
    pair: SentinelCluster,
) -> None:
    """Mid-run the only replica goes away: the append that waited past its timeout
    fails (in doubt, as any unconfirmed append) and its line says why -- the server has
    no replica left to confirm it -- where a lagging replica's line says it lags."""
    store = RedisEventStore(pair.primary.url,
                            replication=StoreConfig(replicas=1, wait_timeout_s=0.3))
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch)
    pair.pause(pair.replica)
    try:
        with pytest.raises(ReplicationTimeoutError, match=r"only 0 of 1 replicas confirmed"
                           r".* has 1 connected replica, which did not confirm in time"):
            store.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
    finally:
        pair.resume(pair.replica)
    pair.replica.stop()
    primary = pair.client(pair.primary)
    pair.wait(lambda: int(primary.info("replication")["connected_slaves"]) == 0, 30,
              "the primary to see its replica gone")
    with pytest.raises(ReplicationTimeoutError) as failed_append:
        store.append(RUN, [failed(3, epoch)], expected_position=2, epoch=epoch)
    said = str(failed_append.value)
    assert "only 0 of 1 replicas confirmed the append within 0.3s" in said
    assert "has 0 connected replicas (store.replicas = 1 wants 1)" in said
    assert "in doubt" in said and "\n" not in said
    store.close()


def test_replicas_zero_does_not_wait(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url)
    epoch = store.claim_epoch(RUN)
    pair.pause(pair.replica)
    try:  # a frozen replica does not slow the primary down: nothing waits for it
        assert store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch) == [1]
    finally:
        pair.resume(pair.replica)
    store.close()


def test_bad_replication_settings_are_named() -> None:
    with pytest.raises(ValueError, match="store.replicas must be >= 0"):
        StoreConfig(replicas=-1)
    with pytest.raises(ValueError, match="store.wait_timeout_s must be > 0"):
        StoreConfig(wait_timeout_s=0)


def test_a_run_whose_replica_drops_away_ends_with_a_line_naming_it(
    pair: SentinelCluster, tmp_path: Path
) -> None:
    """Through ``rl-controller run``: the run trains with its appends confirmed by the
    replica; the replica stops; the append that waited past its timeout (and its
    retries) ends the run with one line saying the server has no replica left -- not a
    stall, and not a later append's conflict with the in-doubt batch hiding the cause."""
    from tests.integration.test_run_cli import _command

    run = "replica-lost"
    argv = [*_command(), "run", "--redis-url", pair.primary.url, "--run-id", run,
            "--data-dir", str(tmp_path / "data"), "--steps", "500", "--no-progress",
            "--local-workers", "--set", "dataplane.kind=memory",
            "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=2",
            "--set", "rollout.samples_per_group=4", "--set", "rollout.groups_per_call=2",
            "--set", "store.replicas=1", "--set", "store.wait_timeout_s=0.5"]
    env = {k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        primary = pair.client(pair.primary)
        pair.wait(lambda: primary.xlen(events_key(run)) >= 30 or proc.poll() is not None,
                  120, "the run to append 30 events")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        held = primary.xlen(events_key(run))
        pair.replica.stop()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    errors = [ln for ln in err.splitlines() if ln.startswith("rl-controller: error:")]
    # exit 4: the run stopped on its store, with the command that continues it
    assert proc.returncode == 4 and len(errors) == 1, err[-3000:]
    assert "Traceback" not in err
    assert "only 0 of 1 replicas confirmed the append" in errors[0], errors[0]
    assert "continue with: " in errors[0] and "run --resume --run-id replica-lost" in errors[0]
    assert "has 0 connected replicas (store.replicas = 1 wants 1)" in errors[0], errors[0]
    # trained on, then stopped: the log holds what it confirmed and the batch in doubt
    assert primary.xlen(events_key(run)) > held


def test_once_an_append_gave_up_in_doubt_every_later_append_fails_with_its_line(
    pair: SentinelCluster,
) -> None:
    """The controller's journal gave up on a batch the primary holds unconfirmed: the
    next append (another batch, at the position the writer last saw) must fail with the
    same line, not reach the store and come back as a conflict with the batch in doubt."""
    import asyncio

    from controller.journal import Journal
    from controller.log_writer import Backoff
    from controller.startup import create_run
    from events import schema as ev

    store = RedisEventStore(pair.primary.url,
                            replication=StoreConfig(replicas=1, wait_timeout_s=0.2))
    writer = create_run(store, RUN, config={}, seed=0, code_version="t", window_versions=1,
                        groups_per_step=1, samples_per_group=2)
    journal = Journal(writer, backoff=Backoff(tries=2, first_delay_s=0.01))

    def admitted(n: int) -> ev.RolloutAdmitted:
        return journal.make(
            ev.RolloutAdmitted, event_id=ev.group_event_id(f"g{n}", "admitted", 1),
            group_id=f"g{n}", attempt=1, prompt_index=0, prompt_ref="p:0", weight_version=0,
            n_samples=2, sample_seed=n)

    pair.replica.stop()
    primary = pair.client(pair.primary)
    pair.wait(lambda: int(primary.info("replication")["connected_slaves"]) == 0, 30,
              "the primary to see its replica gone")
    at = writer.position
    with pytest.raises(StoreUnavailableError) as first:
        asyncio.run(journal.append(admitted(1)))
    assert "failed 2 times" in str(first.value) and "has 0 connected replicas" in str(first.value)
    assert store.last_position(RUN) == at + 1  # in doubt: on the primary, unconfirmed
    with pytest.raises(StoreUnavailableError) as second:
        asyncio.run(journal.append(admitted(2)))
    assert str(second.value) == str(first.value)
    assert store.last_position(RUN) == at + 1 and writer.position == at
    store.close()


def test_a_resume_waits_for_the_runs_replicas_from_its_first_write(
    pair: SentinelCluster, tmp_path: Path
) -> None:
    """``run --resume`` opened the store with the default [store] (no replicas) and set
    the run's own only after ``resume_run``: the epoch claim, the new ControllerStarted
    and the log repair were written without waiting for a replica. With the replica
    frozen, the claim must be what fails -- nothing appended behind it."""
    from controller.config import config_to_dict, load_config
    from controller.startup import create_run
    from tests.integration.test_run_cli import _command

    run = "resumed-replicated"
    cfg = load_config(None, ["run.steps=1", "store.replicas=1", "store.wait_timeout_s=0.3",
                             "dataplane.kind=memory"])
    store = RedisEventStore(pair.primary.url, replication=cfg.store)
    create_run(store, run, config=config_to_dict(cfg), seed=cfg.run.seed, code_version="t",
               window_versions=cfg.staleness.window_versions,
               groups_per_step=cfg.train.groups_per_step,
               samples_per_group=cfg.rollout.samples_per_group)
    held = store.last_position(run)
    store.close()
    # the run's directory, as a run started here would have made it (a resume refuses a
    # --data-dir that holds none: its spill and checkpoints would be missing)
    (tmp_path / "data" / "runs" / run).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"}
    pair.pause(pair.replica)  # connected, so require_replicas passes; it confirms nothing
    try:
        proc = subprocess.run(
            [*_command(), "run", "--resume", "--run-id", run, "--redis-url", pair.primary.url,
             "--data-dir", str(tmp_path / "data"), "--local-workers", "--no-progress",
             "--takeover"],  # this process wrote its ControllerStarted
            env=env, capture_output=True, text=True, timeout=300)
    finally:
        pair.resume(pair.replica)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("rl-controller: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "only 0 of 1 replicas confirmed" in errors[0], errors[0]
    primary = pair.client(pair.primary)
    assert primary.xlen(events_key(run)) == held  # no ControllerStarted written unconfirmed
