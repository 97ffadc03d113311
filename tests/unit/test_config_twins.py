"""One type per component: the config table a user writes is the type the component
takes, and what the run adds (seed, device, dtype, run directory, Ray cluster) comes
beside it in a small runtime context that repeats none of the table's fields.

Read from the source (no torch import): the annotated fields of every class of the
packages (dataclasses, msgspec Structs, NamedTuples, protocols alike) are compared with
every table of the run's ``Config``. A class that carries two or more of one table's
field names, or extends a table, is a twin of it (the six pairs this replaced carried 2
to 7; a field whose type is the table itself is a reference, not a copy). The few
classes that legitimately mirror a table say why in ``MIRRORS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("events", "workers", "controller", "replay", "sim", "cli", "views")

#: records allowed to carry a table's field names, and why they are not twins
MIRRORS = {
    "workers.models.tiny.TinyConfig": (
        "the tiny transformer's architecture (its vocabulary size included), the nn.Module's "
        "own config like an HF PretrainedConfig; build_model derives it from [model]"
    ),
    "controller.core.state.RunState": (
        "the fold's state: the settings RunStarted recorded, as the pure core reads them"
    ),
}

#: the runtime twins this file replaced; none of the names may come back
RETIRED = ("ModelConfig", "SamplingConfig", "VllmOptions", "DataPlaneConfig", "TrainerConfig",
           "LossConfig")

#: (component, its table, its runtime context): the context adds, never repeats
CONTEXTS = (
    ("trainer", "workers.trainer.config.TrainSection", "workers.trainer.config.TrainerRuntime"),
    ("trainer", "workers.loss.config.LossOptions", "workers.trainer.config.TrainerRuntime"),
    ("vLLM engine", "workers.generator.config.VllmSection",
     "workers.generator.vllm_config.VllmRuntime"),
    ("data plane", "workers.dataplane.config.DataPlaneSection",
     "workers.dataplane.config.DataPlaneRuntime"),
    ("a step's loss", "workers.loss.config.LossOptions", "workers.loss.config.StepLoss"),
    ("a step's loss", "workers.models.config.SamplingSection", "workers.loss.config.StepLoss"),
)

#: (file, function, parameter, the table it takes): each component's entry point
ENTRY_POINTS = (
    ("workers/models/factory.py", "build_model", "cfg", "ModelSection"),
    ("workers/models/sampling.py", "draw", "cfg", "SamplingSection"),
    ("workers/models/decoder.py", "sample", "cfg", "SamplingSection"),
    ("workers/models/decoder.py", "__init__", "cfg", "SamplingSection"),
    ("workers/generator/generator.py", "generate_group", "sampling", "SamplingSection"),
    ("workers/generator/vllm_backend.py", "__init__", "options", "VllmSection"),
    ("workers/generator/vllm_config.py", "llm_kwargs", "options", "VllmSection"),
    ("workers/dataplane/__init__.py", "make_dataplane", "config", "DataPlaneSection"),
    ("workers/dataplane/transferqueue.py", "__init__", "cfg", "DataPlaneSection"),
    ("workers/trainer/rank.py", "__init__", "train", "TrainSection | None"),
    ("workers/trainer/parallel.py", "make_optimizer", "train", "TrainSection"),
    ("workers/loss/core.py", "grpo_loss", "cfg", "LossOptions"),
    ("workers/loss/core.py", "microbatch_loss", "loss", "StepLoss"),
)


def _tables() -> dict[str, type]:
    """Every table of the run's config, by dotted key (``train.loss``, ``rollout.vllm``)."""
    from controller.config import Config

    def walk(struct: type, prefix: str) -> dict[str, type]:
        out: dict[str, type] = {}
        for field in msgspec.structs.fields(struct):
            kind = field.type
            if _is_table(kind):
                out[f"{prefix}{field.name}"] = kind
                out.update(walk(kind, f"{prefix}{field.name}."))
        return out

    return walk(Config, "")


def _is_table(kind: object) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__name__}"


def _fields(node: ast.ClassDef) -> dict[str, str]:
    """Field name -> its annotation's source."""
    return {
        stmt.target.id: ast.unparse(stmt.annotation).strip("'\"")
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def _records(source: str, module: str) -> dict[str, dict[str, str]]:
    """Record name -> its fields; a record extending another class also lists the base
    under the key ``"<base>"`` (a subclass of a table inherits every field of it)."""
    tree = ast.parse(source)
    return {
        f"{module}.{node.name}": {
            **_fields(node), **{f"<{ast.unparse(b)}>": "base" for b in node.bases},
        }
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def _all_records() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out.update(_records(path.read_text(), module.removesuffix(".__init__")))
    return out


def _twins(records: dict[str, dict[str, str]], tables: dict[str, type]) -> list[str]:
    """``record ~ [table]: fields`` for each record carrying 2+ of a table's fields."""
    table_names = {_qualname(kind) for kind in tables.values()} | {"controller.config.Config"}
    found = []
    for name, fields in records.items():
        if name in table_names or name in MIRRORS:
            continue
        for key, kind in tables.items():
            own = {f.name: f.type for f in msgspec.structs.fields(kind)}
            shared = sorted(
                f for f in fields.keys() & own.keys()
                # a field holding the table's own sub-table refers to it, copies nothing
                if not (_is_table(own[f]) and fields[f] == own[f].__name__)
            )
            if f"<{kind.__name__}>" in fields:  # the table plus more: the whole table again
                shared = ["<all, by subclassing>"]
            if len(shared) >= 2 or f"<{kind.__name__}>" in fields:
                found.append(f"{name} ~ [{key}]: {shared}")
    return found


def test_the_scan_finds_a_twin_when_there_is_one():
    """The check can fail: a runtime record restating [train]'s lr and weight_decay (the
    old ``OptimizerConfig``) is reported, and so is a subclass of a table (the old
    ``LossConfig``); a reference to a table is not."""
    tables = _tables()
    source = (
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class Optimizer:\n"
        "    kind: str = 'adamw'\n"
        "    lr: float = 1e-5\n"
        "    weight_decay: float = 0.0\n"
        "class Holder(msgspec.Struct):\n"
        "    vllm: VllmSection\n"
        "    loss: LossOptions\n"
        "class Loss(LossOptions, frozen=True):\n"
        "    temperature: float = 1.0\n"
    )
    found = _twins(_records(source, "x"), tables)
    assert found == [
        "x.Optimizer ~ [train]: ['lr', 'weight_decay']",
        "x.Loss ~ [train.loss]: ['<all, by subclassing>']",
    ]


def test_no_record_repeats_a_config_table():
    tables = _tables()
    assert {"train", "train.loss", "rollout.vllm", "dataplane", "model", "sampling"} <= set(tables)
    records = _all_records()
    assert set(MIRRORS) <= set(records), "a MIRRORS entry names a record that is gone"
    assert _twins(records, tables) == []


def test_the_retired_twins_stay_gone():
    back = sorted(name for name in _all_records() if name.rsplit(".", 1)[1] in RETIRED)
    assert back == []


@pytest.mark.parametrize("component, table, context", CONTEXTS)
def test_a_runtime_context_only_adds(component, table, context):
    """Not one field name in common: a value the user sets is read from the table."""
    tables = {_qualname(kind): kind for kind in _tables().values()}
    records = _all_records()
    assert table in tables and context in records, (component, table, context)
    own = {f.name for f in msgspec.structs.fields(tables[table])}
    assert own.isdisjoint(records[context]), (component, own & records[context].keys())
    assert not any(f.startswith("<") for f in records[context]), (component, "subclasses")


def test_each_component_takes_its_table():
    for path, function, param, table in ENTRY_POINTS:
        tree = ast.parse((ROOT / path).read_text())
        defs = [n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == function]
        annotations = {
            ast.unparse(a.annotation).strip("'\"")
            for d in defs for a in d.args.args + d.args.kwonlyargs
            if a.arg == param and a.annotation is not None
        }
        assert annotations == {table}, (path, function, param, annotations)
