"""The workers are handed the config tables they own, take them as they are, and get
the run's own values (seed, run directory, Ray cluster) beside them in a small runtime
context; what they build from the two is pinned here on a config recorded with
non-default choices."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from controller.config import config_from_dict
from controller.wiring import worker_spec
from workers.api import WorkerLostError, worker_label
from workers.dataplane import DataPlaneRuntime
from workers.generator.vllm_config import VllmRuntime, llm_kwargs
from workers.loss import Aggregation, StepLoss
from workers.service import TrainerWorker
from workers.trainer.config import BuiltModelFactory, TrainerRuntime

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "recorded_config.json"


def _custom():
    return config_from_dict(json.loads(FIXTURE.read_text())["custom"])


def test_the_spec_carries_the_config_structs_themselves():
    cfg = _custom()
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.model is cfg.model and spec.task is cfg.task
    assert spec.sampling is cfg.sampling and spec.train is cfg.train
    assert spec.vllm is cfg.rollout.vllm and spec.dataplane is cfg.dataplane
    assert spec.generator_backend == "vllm" and spec.train.backend == "fsdp2"
    assert pickle.loads(pickle.dumps(spec)) == spec  # it crosses to Ray actors


def test_the_runtime_values_come_from_the_run():
    cfg = _custom()
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.seed == 7
    assert BuiltModelFactory(spec.model, spec.seed).model.path == "/models/tiny-hf"
    loss = StepLoss(spec.train.loss, spec.sampling)
    assert loss.options.aggregation is Aggregation.SEQUENCE and loss.options.kl_coef == 0.01
    assert loss.sampling.temperature == 0.7 and loss.sampling.top_p == 0.9
    assert spec.train.runtime(spec.seed) == TrainerRuntime(seed=7, keep_reference=True)
    assert spec.dataplane_runtime == DataPlaneRuntime(
        run_dir=str(Path("/runs/r")), ray_address="", ray_num_cpus=8
    )
    assert spec.dataplane_runtime.spill_dir(spec.dataplane) is None  # spill = false
    engine = llm_kwargs(spec.vllm, VllmRuntime(seed=spec.seed))
    assert (engine["kv_cache_memory_bytes"], engine["max_num_seqs"], engine["seed"]) == (
        64 * 2**20, 64, 7,
    )
    assert spec.vllm.engine_mode == "multiprocess" and spec.vllm.chunk_tokens == 3
    assert spec.refit_bucket_bytes == 64 * 2**20


def test_defaults_no_reference_and_spill_under_the_run():
    cfg = config_from_dict({})
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.sampling.top_p == 1.0  # the whole vocabulary
    assert spec.train.runtime(spec.seed).keep_reference is False
    assert spec.dataplane_runtime.spill_dir(spec.dataplane) == str(Path("/runs/r") / "spill")
    assert spec.vllm.chunk_tokens == 0


def test_the_trainer_worker_runs_the_train_table_itself(tmp_path):
    cfg = config_from_dict({
        "dataplane": {"kind": "memory", "spill": False},
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1},
        "train": {"lr": 0.25, "grad_clip": 0.0, "loss": {"kl_coef": 0.1}},
        "sampling": {"temperature": 0.5},
    })
    worker = TrainerWorker(worker_spec(cfg, "r", tmp_path))
    assert worker.trainer.config is cfg.train and worker.loss.sampling is cfg.sampling
    assert worker.trainer.parallel.optimizer.param_groups[0]["lr"] == 0.25
    assert worker.trainer.parallel.reference is not None  # kl_coef > 0 keeps one
    worker.close()


def test_a_worker_is_named_once_in_errors():
    assert worker_label("trainer", "trainer") == "trainer"  # was "trainer trainer failed"
    assert worker_label("generator", "generator-1") == "generator-1"
    assert worker_label("trainer", "rank-1") == "trainer rank-1"


def test_a_lost_worker_is_named_once_in_its_error():
    # the step a trainer death aborts carries this text as its reason ("trainer trainer lost")
    assert str(WorkerLostError("trainer", "trainer", "ActorDiedError: died")) == (
        "trainer lost: ActorDiedError: died")
    assert str(WorkerLostError("generator-0", "generator", "x")) == "generator-0 lost: x"
    assert str(WorkerLostError("rank-1", "trainer", "x")) == "trainer rank-1 lost: x"


def test_storage_units_default_to_one_on_a_local_ray_and_two_on_a_cluster():
    local = worker_spec(config_from_dict({}), "r", Path("/runs/r"))
    joined = worker_spec(config_from_dict({"ray": {"address": "head:6379"}}), "r", Path("/runs/r"))
    chosen = worker_spec(config_from_dict({"dataplane": {"storage_units": 3}}), "r", Path("/runs/r"))
    got = [s.dataplane.units(s.dataplane_runtime.ray_address) for s in (local, joined, chosen)]
    assert got == [1, 2, 3]
