"""Partial rollouts on the torch generator: flush points, pauses, refits, resuming."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.api import GenerationRequest, SegmentFlush
from workers.batch import collate
from workers.dataplane import MemoryDataPlane
from workers.generator import Generator
from workers.generator.inflight import InflightRunner, InflightStateLost
from workers.generator.segments import expand_runs, segment_key, version_runs
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.tasks import Example, make_task
from workers.weight_sync import cpu_state_dict

CFG = ModelSection(context_len=48, d_model=32, n_heads=2)
SEED = 3
SAMPLING = SamplingSection(max_new_tokens=13)
EXAMPLE = Example("abc>", "cba")


def _runner(plane=None, kv_on_refit="recompute", segment_tokens=4, flush_on_refit=False):
    model, tok = build_model(CFG, SEED)
    plane = plane if plane is not None else MemoryDataPlane()
    gen = Generator(model, tok, make_task("reverse"), plane, "run-1", kv_on_refit=kv_on_refit)
    return InflightRunner(gen, segment_tokens, flush_on_refit), plane


def _req(flushes=0, attempt=1, resume=(), gid="g1"):
    return GenerationRequest(group_id=gid, attempt=attempt, prompt_index=0, n_samples=5,
                             seed=17, flushes=flushes, resume=list(resume))


def _drive(runner, attempt=1, resume=(), between=None, limit=None):
    """Call until done (as the controller would, recording every flush); returns
    (flushes, final outcome or None when stopped after ``limit`` flushes)."""
    flushes: list[SegmentFlush] = []
    while True:
        out = runner.advance([_req(len(flushes), attempt, resume)], [EXAMPLE], SAMPLING)[0]
        if out.status == "done":
            return flushes, out
        assert out.status == "flushed" and out.flush is not None
        flushes.append(out.flush)
        if limit is not None and len(flushes) == limit:
            return flushes, None
        if between is not None:
            between(len(flushes))


def _recorded(plane, flushes, n=5):
    """Each sample's tokens as the recorded segment rows hold them."""
    tokens = [[] for _ in range(n)]
    for f in flushes:
        for seg in f.segments:
            assert seg.start == len(tokens[seg.sample])  # contiguous, never twice
            (row,) = plane.get("run-1", [seg.key])
            assert row["tokens"].shape[0] == seg.length
            tokens[seg.sample] += row["tokens"].tolist()
    return tokens


def test_a_group_flushes_every_segment_tokens_and_commits_what_it_flushed():
    runner, plane = _runner()
    flushes, done = _drive(runner)
    assert len(flushes) == 3  # 13 tokens at most: flushes after 4, 8, 12, then done
    assert [f.segments[0].start for f in flushes] == [0, 4, 8]
    assert flushes[0].segments[0].key == segment_key("run-1", "g1", 1, 0, 0)
    final = plane.get("run-1", done.payload_keys)
    recorded = _recorded(plane, flushes)
    for i, row in enumerate(final):
        p = int(row["prompt_len"])
        completion = row["input_ids"][p:].tolist()
        assert completion[: len(recorded[i])] == recorded[i]
        assert row["token_versions"][:p].eq(-1).all() and row["token_versions"][p:].eq(0).all()
    assert done.version_runs == [[0, n] for n in done.lengths]
    assert runner.tokens_sampled == sum(done.lengths)


@pytest.mark.parametrize("flush_on_refit", [False, True])
def test_a_refit_between_calls_starts_a_new_version_and_each_token_keeps_its_logprob(flush_on_refit):
    runner, plane = _runner(segment_tokens=100, flush_on_refit=flush_on_refit)
    gen = runner.gen
    other, _ = build_model(CFG, 9)
    old = cpu_state_dict(gen.model)

    def refit_at(step_group: str) -> None:
        if runner.tokens_sampled == 5 * 3:  # after 3 token steps, from the generating thread
            gen.update_weights(1, cpu_state_dict(other))

    runner.on_step = refit_at
    flushes, done = _drive(runner)
    if flush_on_refit:
        assert [f.weight_version for f in flushes] == [0]  # the refit closed version 0's window
        assert flushes[0].segments[0].length == 3
    else:  # no window filled: the refit's segment is durable in the final rows alone
        assert flushes == []
    assert done.weight_version_start == 0 and done.weight_version_end == 1
    rows = plane.get("run-1", done.payload_keys)
    model_old, _ = build_model(CFG, SEED)
    model_old.load_state_dict(old)
    for row, runs in zip(rows, done.version_runs):
        p = int(row["prompt_len"])
        versions = row["token_versions"][p:].tolist()
        assert versions == expand_runs(runs) and runs[:2] == [0, 3]
        ids = row["input_ids"]
        want = torch.where(
            torch.tensor(versions) == 0,
            sequence_logprobs(model_old, ids)[p:],
            sequence_logprobs(other, ids)[p:],
        )
        torch.testing.assert_close(row["generator_logprobs"][p:], want, atol=1e-5, rtol=0)
    batch = collate(rows, [0.0] * len(rows))
    assert batch.token_versions.shape == batch.input_ids.shape
    assert batch.token_versions[batch.loss_mask].tolist() == [
        v for runs in done.version_runs for v in expand_runs(runs)
    ]


class _PutWaitsForAck:
    """A data plane whose segment ``put`` waits until the test says the refit was
    acknowledged (60 s at most: a swap that waited for this write would deadlock)."""

    def __init__(self) -> None:
        self.plane = MemoryDataPlane()
        self.acked = threading.Event()
        #: per segment put: had the refit been acknowledged when the write went ahead?
        self.after_ack: list[bool] = []

    def put(self, partition, keys, *args, **kwargs):
        if "/k" in keys[0]:  # a segment row (``segment_key``), not a final row
            self.after_ack.append(self.acked.wait(timeout=60))
        return self.plane.put(partition, keys, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.plane, name)


def test_a_refit_is_acknowledged_before_the_flush_of_the_tokens_it_closes_is_written():
    # The publish (which the trainer awaits) waits for the swap at a token boundary, not
    # for the data-plane write of the tokens sampled before it: that write comes after
    # the ack, in the generating thread, while the publisher goes on.
    plane = _PutWaitsForAck()
    runner, _ = _runner(plane, segment_tokens=100, flush_on_refit=True)
    gen = runner.gen
    other, _ = build_model(CFG, 9)
    holding = threading.Event()

    def hold_for_refit(_gid: str) -> None:
        if runner.tokens_sampled == 5 * 3:  # after 3 token steps: wait until it is queued
            holding.set()
            assert gen.weights.wait_for_pending(timeout_s=60) == 1

    runner.on_step = hold_for_refit
    result: list = []
    generating = threading.Thread(target=lambda: result.append(_drive(runner)))
    generating.start()
    assert holding.wait(timeout=60)  # mid-group: the update must pend until a boundary
    ack = gen.update_weights(1, cpu_state_dict(other))
    plane.acked.set()
    generating.join(timeout=120)
    assert ack.version == 1 and plane.after_ack == [True]
    (flushes, done), = result
    assert [f.weight_version for f in flushes] == [0] and flushes[0].segments[0].length == 3
    assert done.weight_version_end == 1


def test_a_window_that_spans_a_refit_is_flushed_one_version_at_a_time():
    # segment_tokens 4, a refit after 3 token steps: no flush then; the window fills at
    # the 4th token and holds two versions, so v0's 3 tokens are flushed, and v1's token
    # waits for the next window (a crash loses at most segment_tokens either way)
    runner, plane = _runner(segment_tokens=4)
    gen = runner.gen
    other, _ = build_model(CFG, 9)

    def refit_at(_gid: str) -> None:
        if runner.tokens_sampled == 5 * 3:
            gen.update_weights(1, cpu_state_dict(other))

    runner.on_step = refit_at
    flushes, done = _drive(runner)
    longest = max(done.lengths)
    assert [f.weight_version for f in flushes] == [0, 1, 1]
    assert [(s.start, s.length) for s in flushes[0].segments] == [(0, 3)] * 5
    starts = [(f.segments[0].start, max(s.length for s in f.segments)) for f in flushes[1:]]
    assert starts == [(3, 4), (7, 4)] and longest in (12, 13)
    recorded = _recorded(plane, flushes)
    for i, row in enumerate(plane.get("run-1", done.payload_keys)):
        p = int(row["prompt_len"])
        assert row["input_ids"][p:p + len(recorded[i])].tolist() == recorded[i]
        versions = row["token_versions"][p:].tolist()
        assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}
    assert all(not s.stopped for s in flushes[0].segments)  # v0's run ends before the rows do


def test_a_crashed_group_resumes_from_its_recorded_flushes():
    plane = MemoryDataPlane()
    first, _ = _runner(plane)
    recorded, _ = _drive(first, limit=2)  # then the worker "dies" with the rest
    sampled_before = first.tokens_sampled
    second, _ = _runner(plane)  # a fresh worker: nothing in memory
    with pytest.raises(InflightStateLost, match="does not hold it after 2 recorded flushes"):
        second.advance([_req(flushes=2)], [EXAMPLE], SAMPLING)
    flushes, done = _drive(second, attempt=2, resume=recorded)
    seg = flushes[0].segments[0]
    assert seg.start == 8  # attempt 2 begins after the recorded tokens
    assert seg.key == segment_key("run-1", "g1", 2, seg.sample, 0)
    kept = _recorded(plane, recorded)
    rows = plane.get("run-1", done.payload_keys)
    for i, row in enumerate(rows):
        p = int(row["prompt_len"])
        assert row["input_ids"][p:p + len(kept[i])].tolist() == kept[i]
    # nothing recorded was sampled twice: the new worker sampled only what was new
    assert second.tokens_sampled == sum(done.lengths) - sum(len(k) for k in kept)
    assert sampled_before == sum(len(k) for k in kept)


def test_a_resume_row_that_disagrees_with_the_log_is_refused():
    plane = MemoryDataPlane()
    first, _ = _runner(plane)
    recorded, _ = _drive(first, limit=1)
    seg = recorded[0].segments[0]
    plane.put("run-1", [seg.key], [{"tokens": torch.tensor([1]), "logprobs": torch.tensor([0.0])}])
    second, _ = _runner(plane)
    with pytest.raises(ValueError, match=f"segment {seg.key}: the log recorded 4 tokens at 0, the row has 1"):
        second.advance([_req(attempt=2, resume=recorded)], [EXAMPLE], SAMPLING)


def test_groups_after_a_flushing_one_wait_and_dropped_groups_are_forgotten():
    runner, _ = _runner()
    reqs = [_req(gid="g1"), _req(gid="g2")]
    outs = runner.advance(reqs, [EXAMPLE, EXAMPLE], SAMPLING)
    assert [o.status for o in outs] == ["flushed", "pending"]
    runner.advance([_req(gid="g2")], [EXAMPLE], SAMPLING)  # g1 was failed by the controller
    assert set(runner.held) == {"g2"}


def test_version_runs_round_trip():
    assert version_runs([3, 3, 4, 4, 4, -1]) == [3, 2, 4, 3, -1, 1]
    assert expand_runs([3, 2, 4, 3, -1, 1]) == [3, 3, 4, 4, 4, -1]
    assert version_runs([]) == []


def test_flushes_survive_the_whole_process_through_the_spill(tmp_path):
    from workers.dataplane.spill import SpillDataPlane

    first, _ = _runner(SpillDataPlane(MemoryDataPlane(), tmp_path))
    recorded, _ = _drive(first, limit=2)
    plane = SpillDataPlane(MemoryDataPlane(), tmp_path)  # a new process: memory is empty
    assert plane.reload() > 0
    second, _ = _runner(plane)
    flushes, done = _drive(second, attempt=2, resume=recorded)
    kept = _recorded(plane, recorded)
    for i, row in enumerate(plane.get("run-1", done.payload_keys)):
        p = int(row["prompt_len"])
        assert row["input_ids"][p:p + len(kept[i])].tolist() == kept[i]
    assert second.tokens_sampled == sum(done.lengths) - sum(len(k) for k in kept)


def test_the_loss_weighs_each_token_by_its_own_versions_behaviour_logprob():
    """A sample generated across a refit: the IS weight of a token sampled by v1 (the
    trainer's weights) is exactly 1, and that of a token sampled by v0 is the true
    ratio pi_v1 / pi_v0 -- each uses its own behaviour logprob, not the group's."""
    from workers.loss import LossOptions, grpo_loss, token_logprobs

    runner, plane = _runner(segment_tokens=100)
    gen = runner.gen
    v0 = cpu_state_dict(gen.model)
    v1_model, _ = build_model(CFG, 9)
    v0_model, _ = build_model(CFG, SEED)
    v0_model.load_state_dict(v0)

    def refit(_gid: str) -> None:
        if runner.tokens_sampled == 5 * 3:
            gen.update_weights(1, cpu_state_dict(v1_model))

    runner.on_step = refit
    _, done = _drive(runner)
    batch = collate(plane.get("run-1", done.payload_keys), [1.0] * 5)
    with torch.no_grad():
        lp = token_logprobs(v1_model(batch.input_ids), batch.input_ids)  # the trainer at v1
        lp_v0 = token_logprobs(v0_model(batch.input_ids), batch.input_ids)
    cfg = LossOptions(is_cap=1e9)
    by_version = {}
    for v in (0, 1):
        mask = batch.loss_mask & (batch.token_versions == v)
        assert mask.any()
        part = collate(plane.get("run-1", done.payload_keys), [1.0] * 5)
        part.loss_mask = mask
        out = grpo_loss(lp, part, cfg, trainer_version=1)
        by_version[v] = float(out.metrics["is_weight_mean"].value) / int(mask.sum())
        if v == 1:  # the loss's own mismatch check reads the per-token versions too
            assert int(out.metrics["mismatch_tokens"].value) == int(mask.sum())
            assert float(out.metrics["mismatch_logprob_diff_max"].value) < 1e-5
        if v == 0:
            ratios = torch.exp(lp - lp_v0)[mask]
    assert by_version[1] == pytest.approx(1.0, abs=1e-5)
    assert by_version[0] == pytest.approx(float(ratios.mean()), rel=1e-5)
    assert float((ratios - 1).abs().max()) > 0.05  # the versions really differ per token


class _CountedDecode:
    """The ``reverse`` task standing in for a slower model (``SimulatesDecode``) whose
    per-step time is zero: it counts how often a generator asks for that time."""

    def __init__(self) -> None:
        self.inner = make_task("reverse")
        self.name = self.inner.name
        self.asked = 0

    def examples(self, count, seed):
        return self.inner.examples(count, seed)

    def reward(self, example, completion, stopped):
        return self.inner.reward(example, completion, stopped)

    def step_latency_s(self, example, max_steps):
        self.asked += 1
        return 0.0


def test_both_paths_spend_a_slower_models_time_once_per_token_step():
    """Before, the one-call path skipped the time after its last token and the partial
    path did not: partial rollouts paid up to one step more per group in benchmarks."""
    steps = {}
    for path in ("one call", "partial"):
        model, tok = build_model(CFG, SEED)
        task = _CountedDecode()
        gen = Generator(model, tok, task, MemoryDataPlane(), "run-1")
        if path == "one call":
            result = gen.generate_group("g1", EXAMPLE, 5, SAMPLING, 17, attempt=1)
            lengths = result.completion_lens
        else:
            runner = InflightRunner(gen, segment_tokens=4)
            counted = [0]
            runner.on_step = lambda _gid: counted.__setitem__(0, counted[0] + 1)
            flushes, done = _drive(runner)
            lengths = done.lengths
            assert len(flushes) >= 2 and counted[0] == max(lengths)  # flushes cost no time
        steps[path] = (task.asked, max(lengths))
    assert steps["one call"] == steps["partial"]
    assert all(asked == longest for asked, longest in steps.values())


def test_flush_on_refit_is_a_checked_config_key_off_by_default():
    from controller.config import ConfigError, load_config

    assert load_config().rollout.partial.flush_on_refit is False
    assert load_config(overrides=["rollout.partial.flush_on_refit=true"]).rollout.partial.flush_on_refit
    with pytest.raises(ConfigError, match="flush_on_refit"):
        load_config(overrides=["rollout.partial.flush_on_refit=sometimes"])


@pytest.mark.parametrize("kv_on_refit", ["recompute", "keep"])
def test_no_sample_ever_holds_more_than_segment_tokens_outside_the_log_across_refits(kv_on_refit):
    # refits every 3 token steps, windows of 4: splits, stopped samples, a crash after the
    # third flush and a resume with version runs behind it. After every token step no
    # sample has more than segment_tokens tokens that no flush holds, and the final runs
    # agree with every recorded flush (each recorded token at its flush's version).
    plane = MemoryDataPlane()
    models = [cpu_state_dict(build_model(CFG, s)[0]) for s in (9, 10)]
    worst: list[int] = []

    def start(runner):
        gen, steps = runner.gen, [0]

        def refit_and_measure(gid: str) -> None:
            held = runner.held[gid]
            worst.append(max(len(r.tokens) - d for r, d in zip(held.decoder.rows, held.durable)))
            steps[0] += 1
            if steps[0] % 3 == 0:
                gen.update_weights(gen.weights.version + 1, models[gen.weights.version % 2])

        runner.on_step = refit_and_measure
        return runner

    first = start(_runner(plane, kv_on_refit=kv_on_refit)[0])
    recorded, _ = _drive(first, limit=3)
    second = start(_runner(plane, kv_on_refit=kv_on_refit)[0])
    second.gen.update_weights(first.gen.weights.version, models[0])
    flushes, done = _drive(second, attempt=2, resume=recorded)
    assert worst and max(worst) <= 4
    assert done.weight_version_end > done.weight_version_start
    for f in recorded + flushes:
        for seg in f.segments:
            versions = expand_runs(done.version_runs[seg.sample])
            assert versions[seg.start:seg.start + seg.length] == [f.weight_version] * seg.length
