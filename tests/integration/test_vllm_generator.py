"""vLLM generator: sampling with per-token logprobs, in-place weight updates, version tags.

Runs only where vLLM can (a CUDA GPU, or the CPU build); skipped elsewhere. The model
is a randomly initialised GPT-2 written to a temporary directory (no download), with
the project's character tokenizer (vLLM's own tokenizer is not loaded).
"""

from __future__ import annotations

import pytest
import torch

from workers.backends import package_available

pytestmark = [pytest.mark.integration, pytest.mark.gpu]


def _vllm_runs_here() -> bool:
    if not package_available("vllm"):
        return False
    from workers.generator.vllm_backend import vllm_is_cpu_build

    return torch.cuda.is_available() or vllm_is_cpu_build()


if not _vllm_runs_here():
    pytest.skip("needs vLLM and a CUDA GPU (or vLLM's CPU build)", allow_module_level=True)

from workers.dataplane import MemoryDataPlane  # noqa: E402
from workers.generator.vllm_backend import VllmGenerator  # noqa: E402
from workers.models.hf import HFCausalLM  # noqa: E402
from workers.models.sampling import SamplingConfig, sequence_logprobs  # noqa: E402
from workers.models.tokenizer import CharTokenizer  # noqa: E402
from workers.tasks import Example, make_task  # noqa: E402
from workers.weight_sync import StaleWeightsError, cpu_state_dict  # noqa: E402

SAMPLING = SamplingConfig(temperature=0.8, max_new_tokens=8)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def generator(hf_dir):
    gen = VllmGenerator(
        str(hf_dir), CharTokenizer(), make_task("reverse"), MemoryDataPlane(), "run-1",
        chunk_tokens=2,
        llm_options={
            "dtype": "float32", "skip_tokenizer_init": True, "gpu_memory_utilization": 0.3
        },
    )
    return gen


def _policy(hf_dir) -> HFCausalLM:
    from transformers import GPT2LMHeadModel

    return HFCausalLM(GPT2LMHeadModel.from_pretrained(hf_dir).eval())


def _check_logprobs(gen, policy, result):
    rows = gen.dataplane.get(result.partition, result.keys)
    for row in rows:
        want = sequence_logprobs(policy, row["input_ids"], SAMPLING.temperature)
        mask = row["loss_mask"]
        assert torch.allclose(row["generator_logprobs"][mask], want[mask], atol=2e-3)


def test_generation_weight_update_and_version_tags(generator, hf_dir):
    gen, policy = generator, _policy(hf_dir)
    prompt = Example(prompt="abc", answer="cba")
    first = gen.generate_group("g0", prompt, 4, SAMPLING, seed=1)
    assert (first.weight_version_start, first.weight_version_end) == (0, 0)
    assert len(first.keys) == 4 and all(1 <= n <= 8 for n in first.completion_lens)
    _check_logprobs(gen, policy, first)

    # in-place update: the next group samples from (and reports logprobs of) new weights
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert gen.update_weights(1, cpu_state_dict(policy)).version == 1
    second = gen.generate_group("g1", prompt, 4, SAMPLING, seed=1)
    assert (second.weight_version_start, second.weight_version_end) == (1, 1)
    _check_logprobs(gen, policy, second)

    with pytest.raises(StaleWeightsError):
        gen.update_weights(0, cpu_state_dict(policy))


def test_update_landing_mid_group_is_tagged(generator, hf_dir):
    gen, policy = generator, _policy(hf_dir)
    state = cpu_state_dict(policy)
    base = gen.weight_version

    def update_after_first_chunk(chunk: int) -> None:
        if chunk == 0:
            gen.update_weights(base + 1, state)

    gen.on_step = update_after_first_chunk
    try:
        res = gen.generate_group("g2", Example(prompt="abcd", answer="dcba"), 2, SAMPLING, seed=3)
    finally:
        gen.on_step = None
    if max(res.completion_lens) > 2:  # a second chunk ran with the new weights
        assert (res.weight_version_start, res.weight_version_end) == (base, base + 1)
    assert gen.weight_version == base + 1
