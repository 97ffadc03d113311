"""Tampering with a real finished run's log, with a raw client: ``audit`` must see it.

Two real runs (the CLI, in-process workers, a real redis-server): one with a plain
SHA-256 chain, one with an HMAC chain (``store.chain_key_file``). Each case edits the
log the way someone with write access to Redis could, then ``audit`` must exit 1 and
name the first bad position in one line, never a traceback. Every case starts from
the untouched run (its keys are DUMPed once and RESTOREd after each test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cli.main import main
from events.chain import Chain
from events.redis_store import events_key, meta_key, snapshot_key
from tests.chaos.harness import TINY
from tests.conftest import _require_redis_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KEY = b"0123456789abcdef0123456789abcdef"
Entry = list  # [position, {field: value}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = _require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis-tamper"), binary=binary) as srv:
        yield srv


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "chain.key"
    path.write_bytes(KEY)
    return path


@pytest.fixture(scope="module")
def runs(server: RedisServer, key_file: Path, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Train both runs once; return each run's keys as DUMPs."""
    client = redis.Redis.from_url(server.url)
    saved = {}
    for run_id, extra in (("plain", []), ("keyed", ["--set", f'store.chain_key_file="{key_file}"'])):
        data = tmp_path_factory.mktemp(f"data-{run_id}")
        proc = subprocess.run(
            [sys.executable, "-m", "cli.main", "run", "--run-id", run_id, "--steps", "3",
             "--redis-url", server.url, "--data-dir", str(data), *TINY,
             "--set", "controller.snapshot_every_events=25", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        keys = (events_key(run_id), meta_key(run_id), snapshot_key(run_id))
        saved[run_id] = {k: client.dump(k) for k in keys if client.exists(k)}
    client.close()
    return saved


@pytest.fixture
def raw(server: RedisServer, runs) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        for dumps in runs.values():
            for key, blob in dumps.items():
                client.restore(key, 0, blob, replace=True)
        client.close()


def audit(capsys, url: str, run_id: str, *extra: str) -> tuple[int, str, str]:
    try:
        code = main(["audit", "--redis-url", url, "--run", run_id, "--json", *extra])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def read(client: redis.Redis, run_id: str) -> list[Entry]:
    return [
        [int(i.split(b"-")[1]), dict(f)] for i, f in client.xrange(events_key(run_id))
    ]


def rewrite(client: redis.Redis, run_id: str, entries: list[Entry]) -> None:
    """Replace the whole stream (XADD cannot rewrite an entry in place)."""
    key = events_key(run_id)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    for position, fields in entries:
        pipe.xadd(key, fields, id=f"0-{position}")
    pipe.execute()


def first(entries: list[Entry], event_type: str, skip: int = 0) -> Entry:
    return [e for e in entries if e[1][b"type"] == event_type.encode()][skip]


def edit_json(entry: Entry, change: Callable[[dict], None]) -> None:
    body = json.loads(entry[1][b"data"])
    change(body)
    entry[1][b"data"] = json.dumps(body).encode()


def change_reward(client, run_id) -> int:
    entries = read(client, run_id)
    e = first(entries, "GroupCommitted", 1)
    edit_json(e, lambda b: b["rewards"].__setitem__(0, b["rewards"][0] + 1.0))
    rewrite(client, run_id, entries)
    return e[0]


def change_metric(client, run_id) -> int:
    entries = read(client, run_id)
    e = first(entries, "StepFinished")
    edit_json(e, lambda b: b["metrics"].update({k: v * 2 for k, v in b["metrics"].items()}))
    rewrite(client, run_id, entries)
    return e[0]


def change_digest(client, run_id) -> int:
    entries = read(client, run_id)
    e = first(entries, "StepFinished", 1)
    edit_json(e, lambda b: b.update(weights_digest="0" * len(b["weights_digest"])))
    rewrite(client, run_id, entries)
    return e[0]


def delete_entry(client, run_id) -> int:
    client.xdel(events_key(run_id), "0-10")
    return 10


def swap_entries(client, run_id) -> int:
    entries = read(client, run_id)
    a, b = first(entries, "GroupCommitted", 0), first(entries, "GroupCommitted", 2)
    a[1][b"data"], b[1][b"data"] = b[1][b"data"], a[1][b"data"]
    rewrite(client, run_id, entries)
    return a[0]


def forged_append(client, run_id) -> int:
    entries = read(client, run_id)
    last = entries[-1][0]
    body = json.loads(first(entries, "GroupFailed" if any(
        e[1][b"type"] == b"GroupFailed" for e in entries) else "ControllerStarted")[1][b"data"])
    body["event_id"] = body["event_id"] + ":forged"
    fields = {b"type": body["type"].encode(), b"id": body["event_id"].encode(),
              b"data": json.dumps(body).encode(), b"h": b"ab" * 32}
    client.xadd(events_key(run_id), fields, id=f"0-{last + 1}")
    client.hset(meta_key(run_id), mapping={"chain_head": "ab" * 32, "chain_len": last + 1})
    return last + 1


def truncate_tail(client, run_id) -> int:
    last = read(client, run_id)[-1][0]
    client.xdel(events_key(run_id), f"0-{last}", f"0-{last - 1}")
    return last - 1


CASES = [change_reward, change_metric, change_digest, delete_entry, swap_entries,
         forged_append, truncate_tail]


def test_untouched_runs_pass_and_print_the_head(capsys, server, raw, key_file) -> None:
    code, out, err = audit(capsys, server.url, "plain")
    assert code == 0, err
    chain = json.loads(out)["chain"]
    head = raw.hget(meta_key("plain"), "chain_head").decode()
    assert (chain["status"], chain["head"], chain["algorithm"]) == ("ok", head, "sha256")
    code, out, err = audit(capsys, server.url, "keyed", "--chain-key-file", str(key_file))
    assert code == 0, err
    assert json.loads(out)["chain"]["algorithm"] == "hmac-sha256"
    # without the key an HMAC chain cannot be checked; audit says so instead of failing
    code, out, _ = audit(capsys, server.url, "keyed")
    assert code == 0 and json.loads(out)["chain"]["status"] == "unverified"


@pytest.mark.parametrize("run_id", ["plain", "keyed"])
@pytest.mark.parametrize("tamper", CASES, ids=[c.__name__ for c in CASES])
def test_audit_names_the_first_tampered_position(capsys, server, raw, key_file, run_id, tamper):
    position = tamper(raw, run_id)
    code, _, err = audit(capsys, server.url, run_id, "--chain-key-file",
                         str(key_file) if run_id == "keyed" else "")
    assert code == 1, err
    assert f"at position {position}:" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_recomputing_the_chain_without_the_key_is_caught(capsys, server, raw, key_file):
    entries = read(raw, "keyed")
    e = first(entries, "GroupCommitted", 1)
    edit_json(e, lambda b: b["rewards"].__setitem__(0, b["rewards"][0] + 1.0))
    plain = Chain("keyed")  # what a raw-client writer without the key can compute
    prev = entries[e[0] - 2][1][b"h"].decode()
    for position, fields in entries[e[0] - 1:]:
        prev = plain.link(prev, position, fields[b"type"].decode(), fields[b"id"].decode(),
                          fields[b"data"])
        fields[b"h"] = prev.encode()
    rewrite(raw, "keyed", entries)
    raw.hset(meta_key("keyed"), mapping={"chain_head": prev, "chain_alg": "sha256"})
    code, _, err = audit(capsys, server.url, "keyed", "--chain-key-file", str(key_file))
    assert code == 1 and f"at position {e[0]}:" in err


def test_replay_from_a_snapshot_checks_the_hash_there(capsys, server, raw, tmp_path):
    """A consistent recomputed plain chain passes the chain walk; the snapshot does not."""
    data_dir = tmp_path / "data"
    snap_at = int(raw.hget(snapshot_key("plain"), "position"))
    entries = read(raw, "plain")
    e = first(entries, "GroupCommitted", 0)
    assert e[0] < snap_at
    edit_json(e, lambda b: b["rewards"].__setitem__(0, b["rewards"][0] + 1.0))
    chain = Chain("plain")
    prev = chain.genesis if e[0] == 1 else entries[e[0] - 2][1][b"h"].decode()
    for position, fields in entries[e[0] - 1:]:
        prev = chain.link(prev, position, fields[b"type"].decode(), fields[b"id"].decode(),
                          fields[b"data"])
        fields[b"h"] = prev.encode()
    rewrite(raw, "plain", entries)
    raw.hset(meta_key("plain"), "chain_head", prev)
    try:
        code = main(["replay", "--redis-url", server.url, "--run", "plain"])
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert code == 1 and f"position {snap_at}" in err and "Traceback" not in err
    code, _, err = audit(capsys, server.url, "plain")
    assert code == 1 and f"at position {snap_at}:" in err
    # recovery starts from the snapshot too: the resume stops, in one line
    try:
        code = main(["run", "--resume", "--run-id", "plain", "--redis-url", server.url,
                     "--data-dir", str(data_dir), "--local-workers", "--no-progress"])
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert code == 1 and f"hash chain broken at position {snap_at}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
