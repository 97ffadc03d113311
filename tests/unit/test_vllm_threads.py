"""``EngineThreads``: one OpenMP count per calling thread, set before the engine runs.

No vLLM needed: this checks the mechanism the vLLM generator relies on (the engine
test with real vLLM is ``tests/integration/test_vllm_generator.py``).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from workers.generator.vllm_threads import EngineThreads


def _in_fresh_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    return out[0]


def test_pin_fixes_the_count_of_a_thread_new_to_torch_and_it_stays():
    before = torch.get_num_threads()
    threads = EngineThreads(3)
    try:
        torch.set_num_threads(1)  # what the process set elsewhere

        def run() -> tuple[int, int]:
            threads.pin()
            pinned = torch.get_num_threads()
            torch.ones(1 << 16).mul_(2).sum()  # the forward's first parallel ops
            return pinned, torch.get_num_threads()

        assert _in_fresh_thread(run) == (3, 3)
    finally:
        torch.set_num_threads(before)


def test_building_sets_the_environment_and_restores_torch_setter():
    threads = EngineThreads(2)
    real = torch.set_num_threads
    before_env = os.environ.get("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        with threads.building():
            assert os.environ["OMP_NUM_THREADS"] == "2"
            torch.set_num_threads = lambda n: None  # as vLLM's CPU worker does
        assert torch.set_num_threads is real
        assert os.environ.get("OMP_NUM_THREADS") == before_env
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads = real
        torch.set_num_threads(before)


def test_count_defaults_to_torch_and_must_be_positive():
    assert EngineThreads().num_threads == torch.get_num_threads()
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        EngineThreads(0)
