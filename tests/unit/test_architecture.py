"""The package layout's promises, checked: a pure core, and one-way imports.

* ``controller.core`` (state, reducer, policies, fold, step metrics) pulls in nothing
  with I/O, a clock, randomness or logging: importing it in a fresh interpreter must
  leave redis, ray, torch, asyncio and structlog out of ``sys.modules``.
* loading a run's config (``controller.config``, which composes the config types that
  live next to their components) imports no runtime module and none of redis, ray,
  torch, asyncio or structlog;
* ``workers/`` never imports ``controller/``: the contracts between them live in
  ``workers.api``, so the arrow between the two packages runs one way.

The layers as a whole (one-way imports, no cycles) are checked in ``test_layers.py``.
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


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = code + "import json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout))


def test_controller_core_imports_nothing_with_io_clock_or_logging():
    code = (
        "import controller.core.fold, controller.core.policies, controller.core.reducer\n"
        "import controller.core.state, controller.core.step_metrics, controller.core.errors\n"
    )
    loaded = _modules_after(code)
    assert "controller.core.reducer" in loaded  # the import really happened
    leaked = sorted(
        m for m in loaded if m.split(".")[0] in FORBIDDEN_IN_CORE
    )
    assert leaked == [], f"controller.core pulled in {leaked}"


def test_loading_a_config_runs_no_runtime_code():
    """``controller.config`` composes config types only: loading (and validating) a
    config imports no loop, store or worker runtime, and none of redis, ray, torch,
    asyncio or structlog (so ``--help`` and the read-only commands start fast, and a
    config can be checked anywhere)."""
    code = (
        "from controller.config import load_config\n"
        "load_config(overrides=['train.backend=fsdp2', 'train.tensor_parallel=2'])\n"
    )
    loaded = _modules_after(code)
    assert {"workers.trainer.config", "workers.dataplane.config", "controller.settings",
            "events.store_config"} <= loaded
    leaked = sorted(
        m for m in loaded if m.split(".")[0] in (*FORBIDDEN_IN_CORE, "tensordict")
    )
    assert leaked == [], f"loading a config pulled in {leaked[:5]}"
    runtime = sorted(
        m for m in loaded if m.startswith(("controller.", "events.", "workers."))
        and m.rsplit(".", 1)[-1] in {"loop", "admission", "training", "step_close",
                                     "recovery", "journal", "log_writer", "store", "redis_store"}
    )
    assert runtime == [], f"loading a config imported runtime modules {runtime}"


def test_core_modules_import_only_core_and_pure_events():
    allowed_events = {"events.schema", "events.values", "events.codec", "events.errors",
                      "events.config_checks"}
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


def _window_capacity_products(path: Path) -> list[int]:
    """Lines of ``path`` that compute ``x * (<window> + 1)``: the buffer capacity rule."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for side in (node.left, node.right):
                if (
                    isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add)
                    and "window" in ast.unparse(side.left)
                    and isinstance(side.right, ast.Constant) and side.right.value == 1
                ):
                    lines.append(node.lineno)
    return lines


def test_the_capacity_rule_is_written_once():
    """``groups_per_step * (window + 1)`` lives in ``policies.full_capacity``; the
    config, the gate, the replay tools and the simulator call it."""
    found = {
        str(path.relative_to(ROOT)): lines
        for package in ("events", "workers", "controller", "replay", "sim", "cli")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (lines := _window_capacity_products(path))
    }
    assert list(found) == ["controller/core/policies.py"] and len(found[list(found)[0]]) == 1, found


#: table types whose checks another branch in flight moves into the type (the loss
#: options); the list may only shrink
TABLES_CHECKED_ELSEWHERE: set[str] = set()


def _tables(struct: type, prefix: str = "") -> dict[str, type]:
    import msgspec

    out = {}
    for field in msgspec.structs.fields(struct):
        kind = field.type
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            out[f"{prefix}{field.name}"] = kind
            out.update(_tables(kind, f"{prefix}{field.name}."))
    return out


def test_every_config_table_checks_itself():
    """Validation lives in each table's ``__post_init__`` (not in a central list in the
    composer), so a table is checked however it is built."""
    from controller.config import Config

    tables = _tables(Config)
    assert {"train", "rollout.vllm", "store"} <= set(tables)
    unchecked = sorted(
        key for key, kind in tables.items()
        if "__post_init__" not in vars(kind) and kind.__name__ not in TABLES_CHECKED_ELSEWHERE
    )
    assert unchecked == []
    names = {kind.__name__ for kind in tables.values()}
    assert TABLES_CHECKED_ELSEWHERE <= names, "remove what landed from TABLES_CHECKED_ELSEWHERE"
    assert "__post_init__" in vars(Config)  # the rules that span tables


def test_the_cli_imports_no_torch_until_a_command_needs_it():
    """``rl-controller`` builds its parser from every command module (``run``'s
    included), so a module-level import of torch or tensordict anywhere on that path costs
    every read-only command (``runs``, ``tail``, ``audit``) seconds at start-up."""
    code = (
        "import cli.main, cli.run_cmd\n"
    )
    loaded = _modules_after(code)
    assert "controller.loop" in loaded  # the run command's module really was imported
    leaked = sorted(m for m in loaded if m.split(".")[0] in ("torch", "tensordict", "ray"))
    assert leaked == [], f"the CLI pulled in {leaked[:5]}"
