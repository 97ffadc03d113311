"""The workers are handed the config tables they own, and derive from them exactly
the runtime configs the controller used to translate by hand (values pinned from the
translation this replaced, on a config recorded with non-default choices)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from controller.config import config_from_dict
from controller.wiring import worker_label, worker_spec
from workers.dataplane import DataPlaneConfig
from workers.generator.vllm_config import VllmOptions
from workers.loss import Aggregation, LossConfig
from workers.models.factory import ModelConfig
from workers.models.sampling import SamplingConfig
from workers.trainer.config import OptimizerConfig, SchedulerConfig, TrainerConfig

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "recorded_config.json"


def _custom():
    return config_from_dict(json.loads(FIXTURE.read_text())["custom"])


def test_the_spec_carries_the_config_structs_themselves():
    cfg = _custom()
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.model is cfg.model and spec.task is cfg.task
    assert spec.sampling is cfg.sampling and spec.train is cfg.train
    assert spec.vllm is cfg.rollout.vllm
    assert spec.generator_backend == "vllm" and spec.train.backend == "fsdp2"
    assert pickle.loads(pickle.dumps(spec)) == spec  # it crosses to Ray actors


def test_each_component_derives_what_the_hand_translation_gave():
    cfg = _custom()
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.model.model_config(spec.seed) == ModelConfig(
        kind="hf", context_len=32, d_model=64, n_layers=2, n_heads=4, init_seed=7,
        path="/models/tiny-hf",
    )
    assert spec.sampling.sampling_config() == SamplingConfig(
        temperature=0.7, top_p=0.9, max_new_tokens=6
    )
    assert spec.train.loss.loss_config(spec.sampling.temperature) == LossConfig(
        clip_low=0.2, clip_high=0.28, aggregation=Aggregation.SEQUENCE, kl_coef=0.01,
        is_cap=2.0, temperature=0.7,
    )
    assert spec.train.trainer_config(spec.seed) == TrainerConfig(
        optimizer=OptimizerConfig(lr=0.003, weight_decay=0.0),
        scheduler=SchedulerConfig(warmup_steps=0),
        max_grad_norm=1.0, seed=7, keep_reference=True,
    )
    assert spec.dataplane == DataPlaneConfig(
        kind="memory", spill_dir=None, ray_address=None, ray_num_cpus=8,
        num_storage_units=2, storage_node_resource=None,
    )
    assert spec.vllm.options(spec.seed) == VllmOptions(
        engine_mode="multiprocess", kv_cache_bytes=64 * 2**20, max_num_seqs=64,
        chunk_tokens=3, seed=7,
    )
    assert spec.refit_bucket_bytes == 64 * 2**20


def test_defaults_top_p_off_no_reference_and_spill_under_the_run():
    cfg = config_from_dict({})
    spec = worker_spec(cfg, "r", Path("/runs/r"))
    assert spec.sampling.sampling_config().top_p is None
    assert spec.train.trainer_config(spec.seed).keep_reference is False
    assert spec.dataplane.spill_dir == str(Path("/runs/r") / "spill")
    assert spec.vllm.options(spec.seed).chunk_tokens is None


def test_a_worker_is_named_once_in_errors():
    assert worker_label("trainer", "trainer") == "trainer"  # was "trainer trainer failed"
    assert worker_label("generator", "generator-1") == "generator-1"
    assert worker_label("trainer", "rank-1") == "trainer rank-1"


def test_storage_units_default_to_one_on_a_local_ray_and_two_on_a_cluster():
    local = worker_spec(config_from_dict({}), "r", Path("/runs/r"))
    joined = worker_spec(config_from_dict({"ray": {"address": "head:6379"}}), "r", Path("/runs/r"))
    chosen = worker_spec(config_from_dict({"dataplane": {"storage_units": 3}}), "r", Path("/runs/r"))
    assert (local.dataplane.num_storage_units, joined.dataplane.num_storage_units,
            chosen.dataplane.num_storage_units) == (1, 2, 3)
