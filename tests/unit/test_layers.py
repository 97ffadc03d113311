"""The layers, read from the source: one-way imports, no import cycles, and no probing
for a capability that a protocol tier declares.

    cli                          the commands (the top floor)
    replay   sim   views         tools over a log, the simulator, traces and dashboard
    controller                   the loop, its pure core, the wiring
    workers                      trainer, generators, data plane
    events                       the vocabulary and the store (the ground floor)

A module imports its own layer and the layers below, never one above. Every import
counts: at the top of a module, inside a function, and under ``if TYPE_CHECKING:``
(an annotation is still a dependency a reader has to follow, and a cycle through one
is a cycle in the design).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "events": 0, "workers": 1, "controller": 2, "replay": 3, "sim": 3, "views": 3, "cli": 4,
}

#: Cycles a branch in flight removes (the trainer backends by composition; one what-if
#: in one place). The list may only shrink: a cycle that is gone must leave it too.
KNOWN_CYCLES = [
    ["replay.whatif", "replay.whatif_sim"],
]


def _modules() -> dict[str, Path]:
    files = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    return files


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, anywhere in it (``from pkg import sub``
    counts as importing the submodule; ``from pkg import name`` as importing ``pkg``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out.update(subs or {node.module})
    return {name for name in out if name.split(".")[0] in LAYERS}


def import_graph() -> dict[str, set[str]]:
    files = _modules()
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items() for dst in dsts
        if LAYERS[dst.split(".")[0]] > LAYERS[src.split(".")[0]]
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward_imports({"events.x": {"cli.main"}, "cli.main": {"events.x"}}) == [
        "events.x -> cli.main"
    ]
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cli import common\n"
        "def f():\n    import replay.reader\n"
    )
    assert _imports(src, {"cli.common"}) == {"cli.common", "replay.reader"}


def test_the_graph_covers_every_layer():
    graph = import_graph()
    assert {"events.store", "workers.api", "controller.loop", "replay.staleness", "sim.harness",
            "cli.main"} <= set(graph)
    assert "controller.log_writer" in graph["controller.loop"]
    assert "controller.core.reducer" in graph["controller.log_writer"]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles_anywhere_type_checking_imports_included():
    found = cycles(import_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert new == [], f"import cycles: {new}"
    assert gone == [], f"remove from KNOWN_CYCLES, they are gone: {gone}"


def _tier_additions() -> set[str]:
    """Members a capability tier declares on top of the protocol it extends."""
    from events.store import EventStore, ServerEventStore
    from workers.dataplane.api import DataPlane, DurableDataPlane

    def declared(protocol: type) -> set[str]:
        return set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))

    added = set()
    for tier, base in ((ServerEventStore, EventStore), (DurableDataPlane, DataPlane)):
        added |= {n for n in declared(tier) - declared(base) if not n.startswith("_")}
    return added


def test_no_capability_of_a_tier_is_probed_for_with_getattr():
    """``getattr(store, "read_chain_page", None)`` hides a capability from the types;
    the caller asks ``isinstance(store, ServerEventStore)`` instead."""
    names = _tier_additions()
    assert {"read_chain_page", "require_writable", "reload"} <= names
    offenders = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
            ):
                offenders.append(f"{name}:{node.lineno} {node.args[1].value}")
    assert offenders == []


def test_only_the_cli_imports_views() -> None:
    """``views`` shares a floor with replay and sim, but nothing below the commands
    depends on what people look at: only ``cli`` may import it."""
    offenders = sorted(
        f"{src} -> {dst}"
        for src, dsts in import_graph().items() for dst in dsts
        if dst.split(".")[0] == "views" and src.split(".")[0] not in ("views", "cli")
    )
    assert offenders == []
