"""Partial rollouts on vLLM's CPU build: a refit lands between two engine steps.

The engine is stepped by hand (``workers.generator.vllm_decoder``); every token's
logprob is checked against a full Hugging Face forward of the weights of *its* version
(2e-3, as in ``test_vllm_generator``), and a group resumed from its recorded segments
keeps them token for token.
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm_helpers import vllm_skip_reason

_why = vllm_skip_reason()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

from workers.api import GenerationRequest  # noqa: E402
from workers.dataplane import MemoryDataPlane  # noqa: E402
from workers.generator.config import VllmSection  # noqa: E402
from workers.generator.inflight import InflightRunner  # noqa: E402
from workers.generator.vllm_backend import VllmGenerator  # noqa: E402
from workers.generator.vllm_config import VllmRuntime  # noqa: E402
from workers.models.config import SamplingSection  # noqa: E402
from workers.models.hf import load_hf, load_hf_tokenizer  # noqa: E402
from workers.models.hf_tiny import write_tiny_hf_model  # noqa: E402
from workers.models.sampling import sequence_logprobs  # noqa: E402
from workers.tasks import Example, make_task  # noqa: E402
from workers.weight_sync import cpu_state_dict  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

SAMPLING = SamplingSection(temperature=0.8, max_new_tokens=10)
EXAMPLE = Example(prompt="abcd>", answer="dcba")
ATOL = 2e-3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("llama"), seed=0)


@pytest.fixture(scope="module")
def gen(hf_dir):
    g = VllmGenerator(
        str(hf_dir), load_hf_tokenizer(hf_dir), make_task("reverse"), MemoryDataPlane(), "run-1",
        options=VllmSection(kv_cache_mib=32, max_num_seqs=16),
        runtime=VllmRuntime(prefix_caching=False),
        num_threads=1,
    )
    yield g
    g.close()


def _models(hf_dir):
    old, _ = load_hf(hf_dir)
    new, _ = load_hf(hf_dir)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return old, new


def _drive(runner, gid, attempt=1, resume=(), limit=None):
    flushes = []
    while True:
        req = GenerationRequest(group_id=gid, attempt=attempt, prompt_index=0, n_samples=4,
                                seed=3, flushes=len(flushes), resume=list(resume))
        out = runner.advance([req], [EXAMPLE], SAMPLING)[0]
        if out.status == "done":
            return flushes, out
        flushes.append(out.flush)
        if len(flushes) == limit:
            return flushes, None


def test_refit_between_engine_steps_gives_each_token_its_versions_logprob(gen, hf_dir):
    old, new = _models(hf_dir)
    gen.update_weights(gen.weight_version + 1, cpu_state_dict(old))
    v0 = gen.weight_version
    runner = InflightRunner(gen, segment_tokens=100, flush_on_refit=True)
    steps = [0]

    def refit(_gid: str) -> None:
        steps[0] += 1
        if steps[0] == 3:  # from the generating thread: loaded at this token boundary
            gen.update_weights(v0 + 1, cpu_state_dict(new))

    runner.on_step = refit
    flushes, done = _drive(runner, "g-refit")
    assert [f.weight_version for f in flushes] == [v0]
    assert (done.weight_version_start, done.weight_version_end) == (v0, v0 + 1)
    spanning = 0
    for row in gen.dataplane.get("run-1", done.payload_keys):
        p = int(row["prompt_len"])
        versions = row["token_versions"][p:]
        ids = row["input_ids"]
        want = torch.where(
            versions == v0,
            sequence_logprobs(old, ids, SAMPLING.temperature)[p:],
            sequence_logprobs(new, ids, SAMPLING.temperature)[p:],
        )
        assert float((row["generator_logprobs"][p:] - want).abs().max()) < ATOL
        spanning += bool((versions == v0 + 1).any())
    assert spanning > 0


def test_a_group_resumes_on_vllm_from_its_recorded_segments(gen):
    first = InflightRunner(gen, segment_tokens=3)
    recorded, _ = _drive(first, "g-resume", limit=2)
    first.advance([], [], SAMPLING)  # the controller failed it: its requests leave the engine
    assert not gen.llm.llm_engine.has_unfinished_requests()
    second = InflightRunner(gen, segment_tokens=3)
    flushes, done = _drive(second, "g-resume", attempt=2, resume=recorded)
    kept = [[] for _ in range(4)]
    for f in recorded:
        for seg in f.segments:
            (row,) = gen.dataplane.get("run-1", [seg.key])
            kept[seg.sample] += row["tokens"].tolist()
    for i, row in enumerate(gen.dataplane.get("run-1", done.payload_keys)):
        p = int(row["prompt_len"])
        assert row["input_ids"][p:p + len(kept[i])].tolist() == kept[i]
    assert second.tokens_sampled == sum(done.lengths) - sum(map(len, kept))
