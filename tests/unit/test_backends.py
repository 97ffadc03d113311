"""Backend selection by config, and the error each unavailable backend raises.

The availability checks are plain functions of (package installed, CUDA visible,
CPU build), so every message is tested here whatever this machine has installed.
"""

from __future__ import annotations

import pytest

from workers.backends import (
    BackendUnavailableError,
    check_megatron,
    check_vllm,
    make_generator,
    make_trainer,
    package_available,
)
from workers.dataplane import MemoryDataPlane
from workers.generator import Generator
from workers.models.config import ModelSection
from workers.models.factory import build_model
from workers.tasks import make_task
from workers.trainer import RankTrainer
from workers.trainer.options import Fsdp2Options, MegatronOptions
from tests.trainer_helpers import FACTORY, SGD


def test_torch_trainer_is_the_default_choice():
    t = make_trainer("torch", FACTORY, *SGD)
    assert isinstance(t, RankTrainer) and t.parallel.backend == "torch"


def test_torch_trainer_rejects_backend_options():
    with pytest.raises(TypeError, match="'torch' takes no options.*overlap_grad_reduce=True"):
        make_trainer("torch", FACTORY, *SGD, MegatronOptions(overlap_grad_reduce=True))


def test_a_backend_refuses_another_backends_options():
    with pytest.raises(TypeError, match="'megatron' takes MegatronOptions, got Fsdp2Options"):
        make_trainer("megatron", FACTORY, *SGD, Fsdp2Options())


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: make_trainer("deepspeed", FACTORY),
            r"train.backend = 'deepspeed'; expected one of \['torch', 'megatron', 'fsdp2'\]",
        ),
        (
            lambda: make_generator("sglang"),
            r"rollout.backend = 'sglang'; expected one of \['torch', 'vllm'\]",
        ),
    ],
)
def test_unknown_backend_names_the_key_and_the_choices(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_torch_generator_by_config():
    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    gen = make_generator(
        "torch", model=model, tokenizer=tok, task=make_task("reverse"),
        dataplane=MemoryDataPlane(), run_id="run-1",
    )
    assert isinstance(gen, Generator) and gen.weight_version == 0


# -- megatron -------------------------------------------------------------------------


def test_megatron_missing_package_says_how_to_install():
    message = r"needs megatron-core.*rl-controller\[megatron\]"
    with pytest.raises(BackendUnavailableError, match=message):
        check_megatron(installed=False, cuda=True)


def test_megatron_runs_on_cpu_without_the_distributed_optimizer():
    check_megatron(installed=True, cuda=False)  # no error: CPU/gloo is supported


def test_megatron_distributed_optimizer_without_gpu_says_so():
    with pytest.raises(BackendUnavailableError, match="distributed optimizer needs a CUDA GPU"):
        check_megatron(installed=True, cuda=False, require_gpu=True)


def test_make_trainer_megatron_without_the_package():
    if package_available("megatron.core"):
        pytest.skip("megatron-core is installed here (its trainer is tested in integration)")
    with pytest.raises(BackendUnavailableError, match="needs megatron-core"):
        make_trainer("megatron", FACTORY, *SGD)


# -- vLLM -------------------------------------------------------------------------------


def test_vllm_missing_package_says_how_to_install():
    with pytest.raises(BackendUnavailableError, match=r"needs vLLM.*rl-controller\[vllm\]"):
        check_vllm(installed=False, cuda=True)


def test_vllm_without_gpu_says_so_unless_cpu_build():
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU and none is visible"):
        check_vllm(installed=True, cuda=False)
    check_vllm(installed=True, cuda=False, cpu_build=True)  # the CPU build runs on CPU
    check_vllm(installed=True, cuda=True)


def test_make_generator_vllm_here_is_a_clear_error_or_a_gpu():
    if package_available("vllm"):
        pytest.skip("vLLM is installed here (its generator is tested in integration)")
    with pytest.raises(BackendUnavailableError, match="needs vLLM"):
        make_generator("vllm", model_path="unused")
