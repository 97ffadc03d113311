"""A run's keys changed by hand in a real redis-server: every reader says so in one line.

The hash chain covers the entries; the keys around them (meta's epoch and chain length,
the snapshot's position, the stream itself) are plain Redis values someone with write
access can overwrite with anything. A value rl-controller never writes there must stop
the command with exit status 1 and one line naming the key, never a ValueError or a
WRONGTYPE traceback. So must a run id the store cannot hold, given to a reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from cli.main import main
from events.errors import StoreDataError
from events.redis_store import RedisEventStore, events_key, meta_key, snapshot_key
from tests.unit.log_builder import LogBuilder

pytestmark = pytest.mark.integration

RUN = "r1"


@pytest.fixture
def url(redis_url: str) -> Iterator[str]:
    """A real run's log: two steps, a hash chain and a snapshot."""
    log = LogBuilder(run_id=RUN, window=1, groups_per_step=1).start()
    for step in range(2):
        log.admit(f"g{step}").commit(f"g{step}").begin_step().microbatch([f"g{step}"])
        log.finish_step().publish()
    events = [stored.event for stored in log.build()]
    store = RedisEventStore(redis_url)
    try:
        epoch = store.claim_epoch(RUN)
        store.append(RUN, events, expected_position=0, epoch=epoch)
        assert store.save_snapshot(RUN, 3, b"state")
    finally:
        store.close()
    yield redis_url


def command(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    return int(code or 0), err


def overwrite_events(client: redis.Redis) -> None:
    client.delete(events_key(RUN))
    client.set(events_key(RUN), "x")


CASES: list[tuple[str, Callable[[redis.Redis], object], list[str], str]] = [
    ("meta epoch", lambda c: c.hset(meta_key(RUN), "epoch", "abc"), ["runs"],
     f"{meta_key(RUN)} field 'epoch' holds 'abc', not a whole number"),
    ("meta chain_len", lambda c: c.hset(meta_key(RUN), "chain_len", "x"), ["audit", "--run", RUN],
     f"{meta_key(RUN)} field 'chain_len' holds 'x', not a whole number"),
    ("snapshot position (replay)", lambda c: c.hset(snapshot_key(RUN), "position", "zz"),
     ["replay", "--run", RUN], f"{snapshot_key(RUN)} field 'position' holds 'zz'"),
    ("snapshot position (runs)", lambda c: c.hset(snapshot_key(RUN), "position", "zz"),
     ["runs"], f"{snapshot_key(RUN)} field 'position' holds 'zz'"),
    ("stream a string (tail)", overwrite_events, ["tail", "--run", RUN],
     f"key {events_key(RUN)} holds another kind of value"),
    ("stream a string (audit)", overwrite_events, ["audit", "--run", RUN],
     f"key {events_key(RUN)} holds another kind of value"),
    ("stream a string (runs)", overwrite_events, ["runs"], f"XLEN {events_key(RUN)}"),
]


@pytest.mark.parametrize(("edit", "argv", "named"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_key_changed_by_hand_is_one_line(capsys, url, edit, argv, named) -> None:
    client = redis.Redis.from_url(url)
    try:
        edit(client)
    finally:
        client.close()
    code, err = command(capsys, *argv, "--redis-url", url)
    assert code == 1, err
    assert named in err and "outside rl-controller" in err, err
    assert "127.0.0.1" not in err  # the dashboard shows this line: no address
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_claiming_an_epoch_that_is_not_a_number_names_the_key(url) -> None:
    client = redis.Redis.from_url(url)
    client.hset(meta_key(RUN), "epoch", "abc")
    client.close()
    store = RedisEventStore(url)
    try:
        with pytest.raises(StoreDataError, match=r"rlc:\{r1\}:meta"):
            store.claim_epoch(RUN)
        with pytest.raises(StoreDataError, match="field 'epoch' holds 'abc'"):
            store.current_epoch(RUN)
    finally:
        store.close()


@pytest.mark.parametrize("argv", [
    ["tail"], ["replay"], ["audit"], ["staleness"], ["simulate"], ["delete", "--yes"],
])
@pytest.mark.parametrize("run_id", ["bad id", "a{b}"])
def test_a_run_id_the_store_cannot_hold_is_one_line(capsys, redis_url, argv, run_id) -> None:
    code, err = command(capsys, *argv, "--run", run_id, "--redis-url", redis_url)
    assert code == 2, err
    assert err.strip() == (f"rl-controller: error: invalid run id {run_id!r}: 1-200 "
                           "characters, no whitespace or braces")


def test_a_resume_over_a_hand_edited_chain_alg_or_store_table_is_one_line(
        capsys, redis_url, tmp_path) -> None:
    # run --resume reads the recorded [store] table and meta's chain_alg before anything
    # starts; a table that is not one was an AttributeError traceback, an unknown
    # algorithm a line telling the user to restore a key file they never had
    log = LogBuilder(run_id=RUN, window=1, groups_per_step=1).start(config={"store": 5})
    store = RedisEventStore(redis_url)
    try:
        epoch = store.claim_epoch(RUN)
        store.append(RUN, [s.event for s in log.build()], expected_position=0, epoch=epoch)
    finally:
        store.close()
    resume = ["run", "--resume", "--run-id", RUN, "--redis-url", redis_url,
              "--data-dir", str(tmp_path), "--local-workers", "--no-progress"]
    code, err = command(capsys, *resume)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().endswith("config (log): store: Expected `object`, got `int`"), err
    client = redis.Redis.from_url(redis_url)
    client.hset(meta_key(RUN), "chain_alg", "md5")
    client.close()
    code, err = command(capsys, *resume)
    assert code == 2, err
    assert err == (f"rl-controller: error: run '{RUN}': its meta names chain_alg 'md5', neither "
                   "'sha256' nor 'hmac-sha256': it was changed outside rl-controller "
                   "('rl-controller audit' checks the chain)\n")


@pytest.mark.parametrize(("argv", "what"), [
    (["replay"], "malformed entry"), (["staleness"], "malformed entry"),
    (["audit"], "cannot decode event"), (["tail"], "cannot decode event"),
])
def test_an_entry_added_by_hand_with_another_stream_id_is_named_where_it_is(
        capsys, url, argv, what) -> None:
    # XADD with an id like 5-124 puts an entry after every 0-N one: it was reported at
    # position 1 (where the fold stood when the page read failed), not where it is
    client = redis.Redis.from_url(url)
    try:
        last = client.xlen(events_key(RUN))
        client.xadd(events_key(RUN), {"type": "X", "id": "i", "data": "{}"}, id="5-124")
    finally:
        client.close()
    code, err = command(capsys, *argv, "--run", RUN, "--redis-url", url)
    assert code == 1, err
    assert err == (f"rl-controller: error: {what} at position {last + 1}: stream entry id "
                   "'5-124' is not a log position (0-N)\n"), err
