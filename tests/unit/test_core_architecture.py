"""Each decision lives once: checks that fail if a second copy of one comes back.

* the log is written through the ``Journal`` (recovery included): no hand-made wake-up,
  no blocking retry, CheckpointSaved written at one place, "steps after version v" at one;
* one projector folds every log: one reducer dispatch, one ``decode_entries``, one
  ``lag_of``, the staleness gate is the core's, the timeline and the what-if observe
  the one fold;
* decisions come from ``controller.core.decisions`` as ready-made events with canonical
  ids, and the writer fires every crash point that follows an append;
* one what-if vocabulary (``replay.settings``): one key table, one ``flatten``, one plots
  module, the recorded config read typed;
* tests synchronise on conditions, not on sleeps.

Static checks read the source with ``ast`` (production packages only: tests and
benchmarks build events by hand on purpose); behavioural ones run the real writer,
journal, projector and observers on in-memory logs.
"""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest

from controller import crashpoints
from controller.core import decisions, policies
from controller.core.fold import Observer
from controller.core.state import encode_state
from controller.journal import Journal
from controller.log_writer import Backoff, LogWriter
from controller.projector import Projector
from controller.startup import create_run, repair_log
from events import schema as ev
from events.errors import StoreUnavailableError
from events.memory_store import MemoryEventStore
from replay import staleness, whatif
from sim.timeline import TimelineObserver
from tests.unit.random_log import random_run
from tests.unit.test_audit import store_of

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("controller", "events", "replay", "sim", "workers", "cli")


def _sources() -> list[Path]:
    return sorted(p for pkg in PRODUCTION if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _trees() -> dict[str, ast.AST]:
    return {_rel(p): ast.parse(p.read_text(), filename=str(p)) for p in _sources()}


TREES = _trees()


def _name(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _construction_sites(cls: type) -> set[str]:
    """Modules that build an event of ``cls``: ``Cls(...)`` or ``x.make(Cls, ...)``."""
    sites = set()
    for path, tree in TREES.items():
        for call in _calls(tree):
            func = _name(call.func)
            made = func.split(".")[-1] == cls.__name__
            made |= func.endswith("make") and bool(call.args) and (
                _name(call.args[0]).split(".")[-1] == cls.__name__
            )
            if made:
                sites.add(path)
    return sites


# -- 4: the log through the Journal ----------------------------------------------------------


def test_nobody_wakes_the_pumps_by_hand():
    assert not hasattr(Journal, "progressed")
    offenders = [
        path for path, tree in TREES.items() for call in _calls(tree)
        if _name(call.func).endswith("progressed")
    ]
    assert offenders == []


def test_the_loop_and_recovery_append_through_the_journal():
    """Once workers exist every append is ``Journal.append`` (it wakes the pumps and
    retries without blocking); ``LogWriter.append`` is for opening a run only."""
    shell = ["controller/recovery.py", "controller/effects.py", "controller/admission.py",
             "controller/training.py", "controller/step_close.py", "controller/worker_loss.py",
             "sim/harness.py"]
    for path in shell:
        for call in _calls(TREES[path]):
            func = _name(call.func)
            assert not func.endswith("writer.append"), f"{path}: {func}(...) bypasses the Journal"


def test_every_journal_append_is_awaited():
    """``Journal.append`` is a coroutine: called without ``await`` it would append
    nothing, silently (a branch written against the old synchronous append)."""
    offenders = []
    for path, tree in TREES.items():
        awaited = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Await)}
        for call in _calls(tree):
            func = _name(call.func)
            if (func.endswith("journal.append") or func == "j.append") and id(call) not in awaited:
                offenders.append(f"{path}:{call.lineno}")
    assert offenders == []


def test_no_blocking_sleep_on_the_append_path():
    for path in ("controller/log_writer.py", "controller/journal.py"):
        sleeps = [_name(c.func) for c in _calls(TREES[path]) if _name(c.func).endswith("sleep")]
        assert all(s == "asyncio.sleep" for s in sleeps), (path, sleeps)


def test_checkpoint_saved_and_weights_published_are_written_at_one_place():
    assert _construction_sites(ev.CheckpointSaved) == {"controller/effects.py"}
    assert _construction_sites(ev.WeightsPublished) == {"controller/effects.py"}


def test_steps_after_a_version_are_computed_once():
    pattern = re.compile(r"range\([^()]*\+ 1,\s*[\w.]*trainer_version \+ 1\)")
    found = [p for p in _sources() if pattern.search(p.read_text())]
    assert [_rel(p) for p in found] == ["controller/core/state.py"]


class _LostReplies(MemoryEventStore):
    """A store whose first ``n`` append replies are lost (the batch lands, the caller
    hears StoreUnavailableError): the retry must be recognised, not written twice."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lost = n

    def append(self, run_id, events, *, expected_position, epoch):  # type: ignore[override]
        positions = super().append(run_id, events, expected_position=expected_position, epoch=epoch)
        if self.lost:
            self.lost -= 1
            raise StoreUnavailableError("connection reset while reading the reply")
        return positions


def _writer(store: MemoryEventStore) -> LogWriter:
    writer = create_run(store, "r", config={}, seed=0, code_version="t", window_versions=1,
                        groups_per_step=1, samples_per_group=1)
    return writer


def test_a_lost_reply_is_retried_without_blocking_the_event_loop():
    store = _LostReplies(0)
    writer = _writer(store)
    store.lost = 2
    journal = Journal(writer, backoff=Backoff(tries=3, first_delay_s=0.001))
    ran_meanwhile: list[int] = []

    async def main() -> None:
        async def other_pump() -> None:
            ran_meanwhile.append(writer.position)  # runs only if the append yields

        event = writer.make(ev.RolloutAdmitted, event_id=ev.group_event_id("g1", "admitted", 1),
                            group_id="g1", attempt=1, prompt_index=0, prompt_ref="p:0",
                            weight_version=0, n_samples=1, sample_seed=1)
        task = asyncio.create_task(other_pump())
        await journal.append(event)
        await task

    asyncio.run(main())
    assert ran_meanwhile == [2]  # another task ran while the append waited to retry
    assert [s.event.event_id for s in store.read("r")][-1] == "group:g1:admitted:a1"
    assert store.last_position("r") == writer.position == 3  # written once


def test_an_append_gives_up_within_its_budget_in_one_line():
    store = _LostReplies(0)
    writer = _writer(store)
    journal = Journal(writer, backoff=Backoff(tries=3, first_delay_s=0.001))

    class Down(MemoryEventStore):
        def append(self, *a, **k):  # type: ignore[override]
            raise StoreUnavailableError("Redis at redis://db:6379/0 is unavailable: refused")

    writer.store = Down()
    event = writer.make(ev.RunFinished, event_id=ev.run_finished_id(1, 2), reason="x")
    with pytest.raises(StoreUnavailableError) as err:
        asyncio.run(journal.append(event))
    text = str(err.value)
    assert "\n" not in text and "failed 3 times" in text and "refused" in text


# -- 5: one projector -------------------------------------------------------------------------


def test_only_the_projector_folds_a_log():
    """Nothing but the projector (and the pure fold itself) runs the raw fold."""
    users = {
        path for path, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "controller.core.fold"
        and any(a.name in ("fold", "fold_raw", "apply_raw") for a in node.names)
    }
    assert users == {"controller/projector.py"}


def test_one_dispatch_one_decode_entries_one_lag_of():
    handlers = [p for p, t in TREES.items() for n in ast.walk(t)
                if isinstance(n, ast.Name) and n.id == "HANDLERS"]
    assert set(handlers) == {"controller/core/reducer.py"}
    for name in ("decode_entries", "lag_of", "gate_open", "flatten"):
        defs = [p for p, t in TREES.items() for n in ast.walk(t)
                if isinstance(n, ast.FunctionDef) and n.name.lstrip("_") == name]
        assert len(defs) == 1, (name, defs)


def test_staleness_asks_the_core_for_the_gate():
    tree = TREES["replay/staleness.py"]
    steps_ahead = [  # the gate's own formula: live // groups_per_step
        n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv)
        and "live" in ast.unparse(n.left)
    ]
    assert steps_ahead == []
    assert any(_name(c.func) == "policies.gate_open" for c in _calls(tree))


def test_the_staleness_gate_is_the_controllers_gate():
    """At every sample the trace's gate says what ``policies.admission`` says of the state."""
    b = random_run(5, 30, window=1, p_abort=0.1)
    trace, disagreements = staleness.Trace(), []

    class Judge:
        def watches(self):
            def check(event, position, state):
                capacity = staleness.capacity_of(state)
                gate = policies.admission(state, dispatch_version=state.weight_version,
                                          window=state.window_versions,
                                          groups_per_step=state.groups_per_step, capacity=capacity)
                if bool(trace.gate_closed[-1]) == gate.allowed:
                    disagreements.append(position)
            return {cls: check for cls in trace.watches()}

    result = Projector(store_of(b)).get(b.run_id, observers=[trace, Judge()])
    assert result.problem is None and len(trace.gate_closed) > 100
    assert any(trace.gate_closed) and not all(trace.gate_closed)
    assert disagreements == []


def test_readers_are_observers_of_the_one_fold():
    for observer in (staleness.Trace(), TimelineObserver(), whatif.WhatIf(["window=0"])):
        assert isinstance(observer, Observer)


def test_the_projector_starts_from_a_snapshot_and_falls_back_to_the_log():
    b = random_run(2, 12)
    store = store_of(b)
    full = Projector(store).get(b.run_id, snapshot=False).require()
    at = b.last_position // 2
    half = Projector(store).get(b.run_id, until=at).require()
    store.save_snapshot(b.run_id, at, encode_state(half))
    assert Projector(store).get(b.run_id).require() == full
    store.save_snapshot(b.run_id, b.last_position - 1, b"not a state")  # a cache, unusable
    assert Projector(store).get(b.run_id).require() == full
    seen: list[int] = []

    class Count:
        def watches(self):
            return {ev.RunStarted: lambda e, p, s: seen.append(p)}

    Projector(store).get(b.run_id, observers=[Count()])  # observers see the whole log
    assert seen == [1]


# -- 6: decisions return events, the writer owns the crash points ------------------------------


DECISIONS = (ev.GroupEvicted, ev.GroupFailed, ev.StepAborted, ev.PayloadsReleased,
             ev.RunRewound, ev.WorkerLost, ev.EpisodesRestarted)


def test_decision_events_are_built_by_the_core_only():
    for cls in DECISIONS:
        assert _construction_sites(cls) == {"controller/core/decisions.py"}, cls.__name__


def test_no_ad_hoc_event_ids():
    offenders = [
        f"{path}:{kw.value.lineno}"
        for path, tree in TREES.items() for call in _calls(tree) for kw in call.keywords
        if kw.arg == "event_id" and isinstance(kw.value, ast.JoinedStr)
    ]
    assert offenders == []


def test_no_crash_point_after_an_append_is_called_by_hand():
    writer_owned = {name for name, _ in crashpoints.AFTER_APPEND.values()}
    writer_owned |= set(crashpoints.BATCH_POINTS)
    assert writer_owned <= set(crashpoints.CRASH_POINTS)
    by_hand = [
        (path, call.args[0].value)
        for path, tree in TREES.items() for call in _calls(tree)
        if _name(call.func).endswith("crash_point") and call.args
        and isinstance(call.args[0], ast.Constant) and call.args[0].value in writer_owned
    ]
    assert by_hand == []


def test_the_writer_fires_the_points_of_what_it_appended():
    """Armed as ``point:key@worker`` a crash point kills that 'worker' instead of the
    process: here it records who reached which point, in order."""
    hits: list[str] = []
    crashpoints.set_worker_killer(hits.append)
    try:
        crashpoints.rearm("after_rollout_admitted:g1@admit,after_log_repaired@repair,"
                          "after_step_aborted:0@abort")
        store = MemoryEventStore()
        writer = _writer(store)
        writer.append(writer.make(ev.RolloutAdmitted, event_id=ev.group_event_id("g1", "admitted", 1),
                                  group_id="g1", attempt=1, prompt_index=0, prompt_ref="p:0",
                                  weight_version=0, n_samples=1, sample_seed=1))
        writer.append(writer.make(ev.StepBegun, event_id=ev.step_event_id(0, "begun"), step=0,
                                  base_trainer_version=0))
        repair_log(writer, reason="restart")  # StepAborted(0) + GroupFailed(g1), one batch
        assert hits == ["admit", "abort", "repair"]
    finally:
        crashpoints.rearm("")
        crashpoints.set_worker_killer(None)


def test_decisions_use_canonical_ids():
    b = random_run(3, 4)
    state = Projector(store_of(b)).get(b.run_id).require()
    at = decisions.Stamp(epoch=state.epoch, ts=1.0, position=state.position)
    rewound = decisions.run_rewound(state, 0, "why", at)
    assert rewound.event_id == ev.run_rewound_id(state.epoch, state.position)
    assert rewound.lost_steps == [s.step for s in state.steps_after(0)]
    failed = decisions.group_failed("g9", 2, "x" * 900, at)
    assert failed.event_id == "group:g9:failed:a2" and len(failed.reason) == 500


# -- 7: one what-if vocabulary ----------------------------------------------------------------


def test_one_key_table_and_one_plots_module():
    tables = [
        path for path, tree in TREES.items() for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "window" for k in node.keys)
    ]
    assert tables == ["replay/settings.py"]
    plots = [p for p, t in TREES.items() for n in ast.walk(t)
             if isinstance(n, (ast.Import, ast.ImportFrom))
             and "matplotlib" in (getattr(n, "module", None) or "".join(a.name for a in n.names))]
    assert set(plots) == {"replay/plots.py"}


def test_the_recorded_config_is_read_typed():
    tools = [p for p in _sources() if _rel(p).startswith(("replay/", "sim/", "controller/"))]
    raw = [_rel(p) for p in tools if re.search(r"state\.config\.get\(|state\.config\[", p.read_text())]
    assert raw == []
    readers = {p for p, t in TREES.items() for c in _calls(t)
               if _name(c.func).endswith("config_from_dict") and p.startswith(("replay/", "sim/"))}
    assert readers == {"replay/settings.py"}


# -- 10: tests wait on conditions -------------------------------------------------------------


def test_tests_do_not_sleep_to_synchronise():
    """The contract suite waits on events, the Ray head on its node being registered;
    a sleep there is only allowed as the pause of a polling loop."""
    for rel in ("tests/contract/test_event_store.py", "tests/integration/test_ray_cluster.py"):
        tree = ast.parse((ROOT / rel).read_text())
        polled = {id(n) for w in ast.walk(tree) if isinstance(w, ast.While)
                  for n in ast.walk(w)}
        bare = [c.lineno for c in _calls(tree)
                if _name(c.func).endswith("sleep") and id(c) not in polled]
        assert bare == [], (rel, bare)
