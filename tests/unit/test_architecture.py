"""The package layout's promises, checked: a pure core, and one-way imports.

* ``controller.core`` (state, reducer, policies, fold, step metrics) pulls in nothing
  with I/O, a clock, randomness or logging: importing it in a fresh interpreter must
  leave redis, ray, torch, asyncio and structlog out of ``sys.modules``.
* loading a run's config (``controller.config``, which composes the Structs that live
  next to the workers) imports no torch or tensordict, so the CLI stays quick to start;
* ``workers/`` never imports ``controller/``: the contracts between them live in
  ``workers.api``, so the arrow between the two packages runs one way.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_CORE = ("redis", "ray", "torch", "asyncio", "structlog")


def _imported_top_level(path: Path) -> set[str]:
    """Dotted names of every module ``path`` imports (top level or inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_controller_core_imports_nothing_with_io_clock_or_logging():
    code = (
        "import json, sys\n"
        "import controller.core.fold, controller.core.policies, controller.core.reducer\n"
        "import controller.core.state, controller.core.step_metrics, controller.core.errors\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "controller.core.reducer" in loaded  # the import really happened
    leaked = sorted(
        m for m in loaded if m.split(".")[0] in FORBIDDEN_IN_CORE
    )
    assert leaked == [], f"controller.core pulled in {leaked}"


def test_loading_a_config_imports_no_torch():
    code = (
        "import json, sys\n"
        "from controller.config import load_config\n"
        "load_config(overrides=['train.backend=fsdp2', 'train.tensor_parallel=2'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert {"workers.trainer.config", "workers.dataplane.config"} <= loaded
    leaked = sorted(m for m in loaded if m.split(".")[0] in ("torch", "tensordict"))
    assert leaked == [], f"loading a config pulled in {leaked[:5]}"


def test_core_modules_import_only_core_and_pure_events():
    allowed_events = {"events.schema", "events.codec", "events.errors"}
    for path in sorted((ROOT / "controller" / "core").glob("*.py")):
        for name in _imported_top_level(path):
            if name.startswith(("controller", "events")):
                assert name.startswith("controller.core") or name in allowed_events, (
                    f"{path.relative_to(ROOT)} imports {name}"
                )


def test_workers_import_nothing_from_controller():
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "workers").rglob("*.py"))
        for name in _imported_top_level(path)
        if name == "controller" or name.startswith("controller.")
    ]
    assert offenders == []


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports when it runs (``from pkg import
    submodule`` counts as importing the submodule; imports inside functions count too,
    annotations-only imports under ``TYPE_CHECKING`` do not)."""
    files = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        out: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                out.update(subs or ({node.module} & files.keys()))
        out.discard(name)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_workers_or_controller():
    for package in ("workers", "controller", "replay", "cli"):
        assert _cycles(_module_graph(package)) == [], package


def _methods(cls: type) -> dict[str, list[str]]:
    import inspect

    return {
        name: list(inspect.signature(member).parameters)
        for name, member in vars(cls).items()
        if not name.startswith("_") and callable(member)
    }


def test_worker_clients_implement_their_protocols_exactly():
    """Each controller<->worker protocol and its implementation have the same methods
    with the same parameters (protocols are structural: drift would go unnoticed). The
    restarter is a role of ``Workers``, which has more to do."""
    from controller.wiring import Workers
    from workers import api
    from workers.handles import GeneratorClientImpl, PayloadStoreImpl, Publisher, TrainerClientImpl

    pairs = [
        (api.TrainerClient, TrainerClientImpl, True),
        (api.GeneratorClient, GeneratorClientImpl, True),
        (api.WeightPublisher, Publisher, True),
        (api.PayloadStore, PayloadStoreImpl, True),
        (api.WorkerRestarter, Workers, False),
    ]
    for protocol, impl, exact in pairs:
        have = _methods(impl)
        if exact:
            extra = sorted(set(have) - set(_methods(protocol)))
            assert extra == [], f"{protocol.__name__} lacks {extra} that {impl.__name__} has"
        for name, params in _methods(protocol).items():
            assert name in have, f"{impl.__name__} lacks {protocol.__name__}.{name}"
            assert have[name] == params, f"{impl.__name__}.{name}{have[name]} != {params}"
