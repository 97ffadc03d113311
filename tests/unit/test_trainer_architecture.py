"""The trainer's shape, checked: one train step, backends by composition, declared calls.

* The split-API step (begin / microbatch / finish / abort, the global normaliser, the
  one-shot ``train``) is written once, in ``workers.trainer.rank.RankTrainer``; a
  backend supplies strategies (``workers.trainer.parallel``) and no backend class
  inherits another. The loss is called from one place, metrics normalised in one.
* ``TrainerGroup`` is a ``Trainer`` like one rank (same methods, same returns), so the
  trainer worker holds a ``Trainer`` and never asks which kind it has; trainers are
  built only through ``workers.backends.make_trainer``.
* Worker calls are declared (``workers.calls``): no handle call names a method by a
  string, every worker implements its tier exactly, and no module probes an
  object for an undeclared capability with ``getattr``/``hasattr``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "events", "replay", "sim", "workers")
TRAINER = ROOT / "workers" / "trainer"

#: the train step's methods, and every (module, class) allowed to define each: the
#: protocol, the one skeleton, the Ray rank shell and the driver that delegate to it
STEP_METHODS = ("begin_train_step", "train_microbatch", "finish_train_step",
                "abort_train_step", "train")
STEP_DEFINERS = {
    ("api", "Trainer"), ("rank", "RankTrainer"),
    ("actor", "TrainerRankActor"), ("actor", "TrainerGroup"),
}
#: the skeleton's own parts: written once, in RankTrainer
SKELETON_ONLY = ("_global_normaliser", "_forward_backward", "_close_step", "_release")


def _sources(*packages: str) -> dict[str, ast.Module]:
    out = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = ast.parse(path.read_text(), filename=str(path))
    return out


def _classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


# -- one train step ----------------------------------------------------------------------


def test_the_step_methods_are_defined_only_by_the_skeleton_and_its_shells():
    found: dict[str, set[tuple[str, str]]] = {m: set() for m in (*STEP_METHODS, *SKELETON_ONLY)}
    for path, tree in _sources("workers/trainer").items():
        for cls in _classes(tree):
            for name in _methods(cls) & found.keys():
                found[name].add((Path(path).stem, cls.name))
    for name in STEP_METHODS:
        extra = found[name] - STEP_DEFINERS
        assert not extra, f"{name} is written again in {sorted(extra)}: compose a strategy"
    for name in SKELETON_ONLY:
        assert found[name] == {("rank", "RankTrainer")}, (name, found[name])


def test_the_one_shot_train_is_written_once():
    """``train`` bodies delegate to ``train_one_shot``; only it calls begin/finish."""
    for path, tree in _sources("workers").items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name != "train":
                continue
            last = fn.body[-1]
            if isinstance(last, ast.Expr) and ast.unparse(last) == "...":
                continue  # the protocol's stub
            called = {_callee(c) for c in _calls(fn)}
            assert "train_one_shot" in called and "begin_train_step" not in called, path


def test_no_trainer_class_inherits_another():
    """Backends compose strategies; the only base classes defined in the trainer package
    that a trainer class may use are its exceptions and protocols."""
    import importlib

    defined: dict[str, type] = {}
    for path in sorted(TRAINER.glob("*.py")):
        if path.stem in ("megatron_backend", "megatron_model", "megatron_shims"):
            continue  # megatron-core is optional here; checked by source below
        module = importlib.import_module(f"workers.trainer.{path.stem}")
        defined.update({k: v for k, v in vars(module).items()
                        if isinstance(v, type) and v.__module__ == module.__name__})
    for path in sorted(TRAINER.glob("*.py")):
        for cls in _classes(ast.parse(path.read_text())):
            for base in cls.bases:
                name = base.id if isinstance(base, ast.Name) else ""
                if name not in defined:
                    continue
                parent = defined[name]
                allowed = issubclass(parent, BaseException) or getattr(parent, "_is_protocol", False)
                assert allowed, f"{path.name}: {cls.name} inherits {name}"


def test_every_backend_is_a_parallelize_function_and_a_constructor():
    """No class per backend: each backend module exposes ``parallelize_<name>`` and a
    constructor that hands it to ``RankTrainer``."""
    for backend in ("torch", "fsdp2", "megatron"):
        tree = ast.parse((TRAINER / f"{backend}_backend.py").read_text())
        funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert f"parallelize_{backend}" in funcs, backend
        for cls in _classes(tree):
            assert not _methods(cls) & set(STEP_METHODS), f"{backend}: {cls.name}"


def test_the_loss_and_metric_normalisation_are_called_from_one_place():
    sites: dict[str, list[str]] = {"microbatch_loss": [], "grpo_loss": [], "normalise": []}
    for path, tree in _sources("workers").items():
        if "workers/loss/" in path or path.endswith("workers/trainer/metrics.py"):
            continue  # their own definitions
        for call in _calls(tree):
            if _callee(call) in sites:
                sites[_callee(call)].append(path)
    assert sites == {
        "microbatch_loss": ["workers/trainer/rank.py"], "grpo_loss": [],
        "normalise": ["workers/trainer/rank.py"],
    }


# -- TrainerGroup is a Trainer; trainers come from make_trainer ---------------------------


def _signature(cls: type, name: str) -> tuple[list[str], object]:
    sig = inspect.signature(getattr(cls, name))
    return list(sig.parameters), sig.return_annotation


def test_rank_and_group_implement_the_trainer_protocol_exactly():
    from workers.trainer.actor import TrainerGroup
    from workers.trainer.api import Trainer
    from workers.trainer.rank import RankTrainer

    members = [n for n in vars(Trainer) if not n.startswith("_")]
    assert "train_microbatch" in members and "close" in members
    for impl in (RankTrainer, TrainerGroup):
        for name in members:
            if isinstance(vars(Trainer)[name], property):
                assert isinstance(getattr(impl, name), property), (impl.__name__, name)
                continue
            assert _signature(impl, name) == _signature(Trainer, name), (impl.__name__, name)


def test_the_trainer_worker_holds_a_trainer_and_never_asks_which_kind():
    tree = ast.parse((ROOT / "workers" / "service.py").read_text())
    worker = next(c for c in _classes(tree) if c.name == "TrainerWorker")
    annotated = [
        ast.unparse(n.annotation) for n in ast.walk(worker)
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "self.trainer"
    ]
    assert annotated == ["Trainer"]
    assert "isinstance" not in {_callee(c) for c in _calls(worker)}


def test_trainers_are_built_only_through_make_trainer():
    constructors = {"RankTrainer", "TorchTrainer", "Fsdp2Trainer", "MegatronTrainer"}
    for path, tree in _sources(*PACKAGES).items():
        if path in ("workers/backends.py",) or path.startswith("workers/trainer/"):
            continue
        built = sorted({_callee(c) for c in _calls(tree)} & constructors)
        assert not built, f"{path} builds {built} itself: use workers.backends.make_trainer"
    actor = ast.parse((TRAINER / "actor.py").read_text())
    assert not {_callee(c) for c in _calls(actor)} & constructors


# -- declared worker calls and capabilities ------------------------------------------------


def test_no_handle_call_names_its_method_by_a_string():
    for path, tree in _sources(*PACKAGES, "tests", "bench").items():
        for call in _calls(tree):
            if _callee(call) not in ("call", "submit", "relay", "ref") or not call.args:
                continue
            first = call.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                pytest.fail(f"{path}:{call.lineno} calls a worker by the string {first.value!r}")


def test_undeclared_calls_are_refused_before_they_are_sent():
    from workers.calls import GeneratorCalls, TrainerCalls, WorkerCalls, call_name

    assert call_name(TrainerCalls.begin_train_step) == "begin_train_step"
    assert call_name(GeneratorCalls.pid) == call_name(WorkerCalls.pid) == "pid"
    with pytest.raises(TypeError, match="not a worker call declared"):
        call_name(lambda: None)


def test_each_worker_implements_its_call_tier_exactly():
    from workers.calls import GeneratorCalls, TrainerCalls, declared_calls
    from workers.service import GeneratorWorker, TrainerWorker

    for tier, worker in ((TrainerCalls, TrainerWorker), (GeneratorCalls, GeneratorWorker)):
        for name, fn in declared_calls(tier).items():
            assert hasattr(worker, name), f"{worker.__name__} lacks {tier.__name__}.{name}"
            want = list(inspect.signature(fn).parameters)
            assert list(inspect.signature(getattr(worker, name)).parameters) == want, name


#: capability probes allowed in workers/, each on an object we do not own (its API is
#: not ours to declare) or on something that is not a capability
PROBES_ALLOWED = {
    ("workers/generator/vllm_backend.py", "engine_core"): "vLLM engine internals",
    ("workers/generator/vllm_backend.py", "shutdown"): "vLLM engine internals",
    ("workers/trainer/megatron_backend.py", "config"): "a user module's mcore config",
}


def _probes(tree: ast.AST) -> list[tuple[str, int]]:
    """(attribute, line) of each probe by name: ``getattr(x, "name", default)`` or
    ``hasattr(x, "name")``. A computed name is dispatch (a call by its declared name,
    a dataclass's own fields), not a probe."""
    out = []
    for call in _calls(tree):
        if not isinstance(call.func, ast.Name) or len(call.args) < 2:
            continue
        attr = call.args[1]
        if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
            continue
        if call.func.id == "hasattr" or (call.func.id == "getattr" and len(call.args) == 3):
            out.append((attr.value, call.lineno))
    return out


def test_no_undeclared_capability_is_probed_in_workers():
    for path, tree in _sources("workers").items():
        for attr, line in _probes(tree):
            if (path, attr) in PROBES_ALLOWED:
                continue
            pytest.fail(f"{path}:{line} probes {attr!r}: declare it in a protocol instead")


def test_the_declared_capabilities_are_never_probed_anywhere():
    declared = {"token", "handle", "shutdown", "close", "ref", "relay", "load_weight_stream"}
    for path, tree in _sources(*PACKAGES).items():
        for attr, line in _probes(tree):
            if attr in declared and (path, attr) not in PROBES_ALLOWED:
                pytest.fail(f"{path}:{line} probes {attr!r}, which a protocol declares")
