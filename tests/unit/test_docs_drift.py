"""What the words say matches the code: cited files exist, messages name real config
keys, and ``docs/architecture.md`` draws the folders and layers that are there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("events", "workers", "controller", "replay", "sim", "views", "cli", "tests", "bench")

#: ``<table>.<key> = ...`` / ``... must`` / ``... needs`` / ``... is required`` in a message
_KEY_IN_MESSAGE = re.compile(r"(?<![\w.])([a-z_]+(?:\.[a-z_0-9]+)+) (?:=|must|needs|is required)")
#: dotted names in messages that are not config keys, and what they are instead
NOT_CONFIG_KEYS = {
    "megatron.use_distributed_optimizer": "a megatron backend option (workers.backends)",
    "sys.stdout": "Python in the source of reasoning-gym's child process (workers.envs.reasoning_gym)",
}


def _python_files(packages=SOURCES):
    for package in packages:
        if (ROOT / package).is_dir():
            yield from sorted((ROOT / package).rglob("*.py"))


def _strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def _config_keys() -> set[str]:
    from controller.config import Config, config_to_dict

    def walk(data: dict, prefix: str = ""):
        for key, value in data.items():
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    return set(walk(config_to_dict(Config())))


def test_every_markdown_file_the_code_cites_exists():
    cited = {
        (path.relative_to(ROOT), name)
        for path in _python_files()
        for text in _strings(path) if path.name != "test_docs_drift.py"
        for name in re.findall(r"[\w./-]+\.md\b", text)
    }
    assert len(cited) > 10, "no citation found: the scan is broken"
    missing = sorted(
        f"{where}: {name}" for where, name in cited
        if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists()
    )
    assert missing == []


def test_messages_name_config_keys_that_exist():
    keys = _config_keys()
    assert {"train.backend", "rollout.vllm.kv_cache_mib", "store.replicas"} <= keys
    named = {
        (path.relative_to(ROOT), key)
        for path in _python_files(tuple(LAYERS))
        for text in _strings(path)
        for key in _KEY_IN_MESSAGE.findall(text)
    }
    assert len(named) > 10, "no key found in a message: the scan is broken"
    wrong = sorted(
        f"{where}: {key}" for where, key in named if key not in keys | NOT_CONFIG_KEYS.keys()
    )
    assert wrong == []


def test_the_scans_catch_what_they_look_for():
    assert _KEY_IN_MESSAGE.findall("trainer.backend = 'x' needs y") == ["trainer.backend"]
    assert _KEY_IN_MESSAGE.findall("config: model.path is required") == ["model.path"]
    assert "trainer.backend" not in _config_keys()


def test_architecture_doc_draws_the_folders_and_layers_there_are():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted(
        str(init.parent.relative_to(ROOT))
        for package in LAYERS if (ROOT / package).is_dir()
        for init in (ROOT / package).rglob("__init__.py")
    )
    assert "controller/core" in folders
    undrawn = [f for f in folders if not re.search(rf"(^|\s){re.escape(f.split('/')[-1])}/", doc, re.M)]
    assert undrawn == [], f"docs/architecture.md does not show {undrawn}"
    by_layer: dict[int, list[str]] = {}
    for package, layer in LAYERS.items():
        by_layer.setdefault(layer, []).append(package)
    order = " -> ".join(", ".join(by_layer[n]) for n in sorted(by_layer))
    assert f"Layer order: {order}." in doc, f"the layer line should read: {order}"


def test_architecture_doc_names_every_cli_module():
    # the cli/ block lists its modules one by one (run_summary.py and views_cmd.py were
    # missing from it); a new command module must be added there too
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc[doc.index("\ncli/ "):]
    block = block[:block.index("```")]
    modules = sorted(p.name for p in (ROOT / "cli").glob("*.py") if p.name != "__init__.py")
    assert len(modules) > 10, "cli/ was not found"
    assert [m for m in modules if not re.search(rf"(^|\s){re.escape(m)}(\s|$)", block, re.M)] == []
