"""The package layout's promises, checked: a pure core, and one-way imports.

* ``controller.core`` (state, reducer, policies, fold, step metrics) pulls in nothing
  with I/O, a clock, randomness or logging: importing it in a fresh interpreter must
  leave redis, ray, torch, asyncio and structlog out of ``sys.modules``.
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
