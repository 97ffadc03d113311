"""The dashboard's JSON and pages through Starlette's TestClient (no browser, no server).

The live stream and the page itself are tested in a real Chromium
(``tests/integration/test_dashboard_browser.py``); here: the runs list, the event
table's filters against the log they search, errors as one message, the trace of the
newest steps, and the audit status of a log that breaks an invariant.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from events.codec import encode
from events.memory_store import MemoryEventStore
from tests.trace_check import check_trace
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run
from views.dashboard import history
from views.dashboard.app import create_app
from views.dashboard.model import RunView
from views.source import fold


def store_of(b: LogBuilder, garbage_at: int = 0) -> MemoryEventStore:
    store = MemoryEventStore()
    store.claim_epoch(b.run_id)
    for s in b.events:
        data = b"{not json" if s.position == garbage_at else encode(s.event)
        store.append_raw(b.run_id, data, event_type=type(s.event).__name__, event_id=s.event.event_id)
    return store


@pytest.fixture(scope="module")
def run() -> LogBuilder:
    return random_run(6, 30, p_abort=0.1, p_restart=0.05)


@pytest.fixture(scope="module")
def client(run: LogBuilder) -> TestClient:
    return TestClient(create_app(store_of(run)))


def test_runs_and_pages(client: TestClient, run: LogBuilder) -> None:
    from events.schema import EVENT_TYPES

    assert client.get("/api/runs").json() == {"runs": [
        {"run_id": run.run_id, "events": run.last_position, "epoch": 1, "finished": True}],
        "default": None, "event_types": sorted(set(EVENT_TYPES) - {"EpisodeTurnsRecorded"})}
    for path in ("/", f"/run/{run.run_id}", f"/run/{run.run_id}/trace", "/static/dashboard.js"):
        assert client.get(path).status_code == 200, path
    js = client.get("/vendor/plotly.min.js")
    assert js.status_code == 200 and b"plotly" in js.content[:2000].lower()


def test_the_type_filter_finds_exactly_those_events_newest_first(client, run) -> None:
    want = [s.position for s in reversed(run.events) if type(s.event).__name__ == "StepAborted"]
    got = client.get(f"/api/runs/{run.run_id}/events", params={"type": "StepAborted"}).json()
    assert [e["position"] for e in got["events"]] == want and want
    assert got["scanned_from"] == 1 and got["end"] == run.last_position


def test_a_search_cut_by_its_limit_says_where_it_stopped(client, run) -> None:
    """The page prints "N matches in positions scanned_from..end": a search that filled
    its limit mid-page named the page's first position, though the entries below the
    last match were never read (and a later match there was not "absent")."""
    want = [s.position for s in reversed(run.events) if type(s.event).__name__ == "StepAborted"]
    got = client.get(f"/api/runs/{run.run_id}/events",
                     params={"type": "StepAborted", "limit": 1}).json()
    assert [e["position"] for e in got["events"]] == want[:1] and len(want) > 1
    assert got["scanned_from"] == want[0]


def test_the_group_and_step_filters(client, run) -> None:
    group = "g0000010"
    want = [s.position for s in reversed(run.events)
            if getattr(s.event, "group_id", None) == group or group in (getattr(s.event, "group_ids", None) or ())]
    got = client.get(f"/api/runs/{run.run_id}/events", params={"group": group, "limit": 500}).json()
    assert [e["position"] for e in got["events"]] == want
    steps = client.get(f"/api/runs/{run.run_id}/events", params={"step": 7, "limit": 500}).json()
    assert {e["step"] for e in steps["events"]} == {7}
    assert len(steps["events"]) == sum(1 for s in run.events if getattr(s.event, "step", None) == 7)


@pytest.mark.parametrize(("params", "message"), [
    ({"type": "Nope"}, "unknown event type 'Nope'"),
    ({"limit": "0"}, "limit must be in 1..500"),
    ({"step": "x"}, "must be integers"),
])
def test_bad_filters_are_one_message(client, run, params, message) -> None:
    answer = client.get(f"/api/runs/{run.run_id}/events", params=params)
    assert answer.status_code == 400 and message in answer.json()["error"]


def test_an_unknown_run_is_404(client) -> None:
    for path in ("events", "stream", "trace"):
        answer = client.get(f"/api/runs/nope/{path}")
        assert answer.status_code == 404 and answer.json() == {"error": "no run 'nope'"}


def test_the_trace_shows_the_newest_steps(client, run) -> None:
    doc = json.loads(client.get(f"/api/runs/{run.run_id}/trace").content)
    found = check_trace(doc)
    last = max(s.event.step for s in run.events if hasattr(s.event, "step"))
    steps = {n for *_, n in found.slices[(1, 1)] if n.startswith("step ")}
    assert {f"step {last}", f"step {last - 2}"} <= steps and f"step {last - 3}" not in steps
    bad = client.get(f"/api/runs/{run.run_id}/trace", params={"steps": "9:3"})
    assert bad.status_code == 400 and "steps '9:3'" in bad.json()["error"]


def test_a_broken_invariant_is_the_audit_status_and_a_malformed_entry_a_row() -> None:
    b = LogBuilder(run_id="r-bad").start().admit("g1").commit("g1")
    b.begin_step().microbatch(["g1"]).finish_step()
    b.begin_step().microbatch(["g1"]).finish_step()  # g1 consumed twice
    store = store_of(b)
    view = RunView(b.run_id)
    view.loaded(fold(store, b.run_id, observers=[view]), [])
    audit = view.snapshot()["audit"]
    assert not audit["ok"] and "invariant violated at position" in audit["text"]
    broken = store_of(LogBuilder(run_id="r-garbled").start().admit("g1"), garbage_at=3)
    rows = history.tail_rows(broken, "r-garbled", 3)
    assert [r["type"] for r in rows] == ["RunStarted", "ControllerStarted", "malformed"]


class _GrowingStore(MemoryEventStore):
    """A store another writer appends to while the dashboard folds: each time the log's
    end is asked for, one more event has landed."""

    def __init__(self, pending: list) -> None:
        super().__init__()
        self.pending = pending

    def last_position(self, run_id: str) -> int:
        if self.pending:
            s = self.pending.pop(0)
            self.append_raw(run_id, encode(s.event), event_type=type(s.event).__name__,
                            event_id=s.event.event_id)
        return super().last_position(run_id)


def test_the_live_tail_follows_on_from_the_folded_state_of_a_growing_log() -> None:
    from views.dashboard.app import _load

    b = random_run(8, 6)
    store = _GrowingStore(list(b.events[40:]))
    store.claim_epoch(b.run_id)
    for s in b.events[:40]:
        store.append_raw(b.run_id, encode(s.event), event_type=type(s.event).__name__,
                         event_id=s.event.event_id)
    view = RunView(b.run_id)
    start = _load(store, b.run_id, view)
    assert start == view.state.position < MemoryEventStore.last_position(store, b.run_id)
    rest = [(s.position, s.event) for s in b.events[start:]]
    update = view.apply(rest)  # what the stream delivers after ``start``: no gap
    assert update["audit"]["ok"] and update["position"] == b.last_position


def test_the_event_table_shows_every_field_of_a_value_as_tail_does():
    # the wire leaves a value's defaults out (events/values.py); the table must not
    from events import schema as ev
    from events.values import EnvResult
    from views.dashboard.model import event_row

    event = ev.EnvStepsCompleted(event_id="e", epoch=1, ts=0.0, group_id="g", attempt=1, index=0,
                                 results=[EnvResult(sample=0, turn=0, reward=1.0)])
    assert b'"ended"' not in encode(event)
    details = event_row(7, event)["details"]
    assert '"ended":false' in details and '"restart":0' in details, details


class _HandEditedStore(MemoryEventStore):
    """A store whose run keys someone overwrote by hand: every read of them refuses, as
    ``RedisEventStore`` does (``tests/integration/test_store_data_errors.py``)."""

    def list_runs(self, *args, **kwargs):
        from events.errors import StoreDataError

        raise StoreDataError("rlc:{r1}:meta field 'epoch' holds 'abc', not a whole number")

    read_page = read_raw = last_position = list_runs  # type: ignore[assignment]


def test_a_malformed_or_hand_edited_log_is_one_message_not_a_500() -> None:
    b = LogBuilder(run_id="r1", groups_per_step=1).start()
    for g in ("g1", "g2"):
        b.admit(g).commit(g).begin_step().microbatch([g]).finish_step()
    finished = next(s.position for s in b.events if type(s.event).__name__ == "StepFinished")
    client = TestClient(create_app(store_of(b, garbage_at=finished)), raise_server_exceptions=False)
    trace = client.get("/api/runs/r1/trace", params={"steps": "0:1"})
    assert trace.status_code == 422
    assert trace.json() == {"error": f"cannot decode event at position {finished}: not a JSON "
                                     "object: JSON is malformed: object keys must be strings "
                                     "(byte 1)"}
    edited = _HandEditedStore()
    edited.claim_epoch("r1")
    client = TestClient(create_app(edited), raise_server_exceptions=False)
    for path in ("/api/runs", "/api/runs/r1/events", "/api/runs/r1/trace"):
        answer = client.get(path)
        assert answer.status_code == 422, path
        assert "field 'epoch' holds 'abc'" in answer.json()["error"], path
    with client.stream("GET", "/api/runs/r1/stream") as stream:
        first = next(stream.iter_lines())
    assert json.loads(first.removeprefix("data: "))["kind"] == "error"
    assert "field 'epoch' holds 'abc'" in first


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_before_anything_is_served(redis_url, capsys, monkeypatch, host):
    # "" is the socket API's every-interface address: --host "" served the unauthenticated
    # page on 0.0.0.0 (and said "serving on 0.0.0.0" only after binding)
    from cli.main import main

    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["dashboard", "--redis-url", redis_url, "--host", host, "--run", "no-such-run"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err == (f"rl-controller: error: --host {host!r} names no address: pass 127.0.0.1 "
                   "(the default, this machine only) or 0.0.0.0 (every interface, no "
                   "authentication)"), err
