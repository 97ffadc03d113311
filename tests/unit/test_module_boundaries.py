"""Who may import what, checked over the source (docs/DESIGN.md, "Layout").

Only the Redis event store's own modules import ``redis`` (the store, its pinned
connection, WAIT replication and Sentinel discovery) -- never ``replay/``, the
controller or the workers -- and one module imports ``transfer_queue`` (the data plane
adapter); the embedded-server manager runs the binary but never speaks the protocol.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the project's code (tests may use client libraries and fakes freely)
PACKAGES = ("events", "controller", "workers", "replay", "sim", "views", "cli", "bench")


def _sources() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif (  # importlib.import_module("x") / __import__("x")
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    return found


def _importers(top_level: str) -> list[str]:
    return [
        str(path.relative_to(ROOT))
        for path in _sources()
        if any(m == top_level or m.startswith(top_level + ".") for m in _imported_modules(path))
    ]


def test_the_scan_sees_the_whole_project() -> None:
    files = [str(p.relative_to(ROOT)) for p in _sources()]
    assert "events/redis_store/store.py" in files and "controller/projector.py" in files
    assert len(files) > 60


def test_only_the_redis_store_imports_redis() -> None:
    importers = _importers("redis")
    # the store, its connection and the Sentinel opener do speak it (guards the scan)
    assert {"events/redis_store/store.py", "events/redis_store/sentinel.py"} <= set(importers)
    outside = [f for f in importers if not f.startswith("events/redis_store/")]
    assert not outside, f"redis imported outside events/redis_store/: {outside}"


def test_only_the_adapter_imports_transfer_queue() -> None:
    assert _importers("transfer_queue") == ["workers/dataplane/transferqueue.py"]


def test_the_embedded_server_manager_does_not_speak_the_protocol() -> None:
    tree = ast.parse((ROOT / "events" / "embedded.py").read_text())
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not calls & {"create_connection", "sendall", "send", "recv", "connect"}
