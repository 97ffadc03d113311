"""The split train-step API of the torch trainer at world size 1 (in-process)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from workers.loss import Aggregation, Metric, MetricKind
from workers.trainer import (
    NonFiniteGradientError,
    StepPhase,
    TorchTrainer,
    TrainStepStateError,
)
from workers.trainer.metrics import DEFAULT_KIND, MetricAccumulator, combine, kind_of, normalise
from tests.trainer_helpers import (
    ADAMW,
    ADAMW64,
    FACTORY,
    SEQUENCE,
    SGD,
    SGD64,
    TOKEN,
    make_batch,
    max_param_diff,
    metric_tolerance,
    oneshot_reference,
    split,
    weight_tolerance,
)

PARTITIONS = {"one": [8], "uneven3": [3, 1, 4], "singletons": [1] * 8}


def snapshot(t: TorchTrainer) -> dict:
    """Everything abort must leave bitwise unchanged."""
    return {
        "weights": t.export_weights(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "version": t.trainer_version,
        "rng": torch.get_rng_state(),
        "grads": [p.grad for p in t.model.parameters()],
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# -- parity: split over K microbatches == one-shot train() -------------------------


#: float64 is the exactness check (<= 1e-12); float32 (the production dtype) is kept at
#: the tolerance its optimizer allows (see tests/trainer_helpers.py)
CONFIGS = {"sgd64": SGD64, "adamw64": ADAMW64, "sgd32": SGD, "adamw32": ADAMW}


@pytest.mark.parametrize("partition", list(PARTITIONS))
@pytest.mark.parametrize("loss", [TOKEN, SEQUENCE], ids=["token", "sequence"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_split_matches_oneshot(config, loss, partition):
    batches = [make_batch(10), make_batch(11)]
    want, want_results, initial = oneshot_reference(config, loss, batches)
    t = TorchTrainer(FACTORY, *config)
    results = []
    for step, batch in enumerate(batches):
        t.begin_train_step(step, loss)
        mbs = split(batch, PARTITIONS[partition])
        for i, mb in enumerate(mbs):
            t.train_microbatch(mb)
            if i == 0:
                t.train_microbatch(None)  # a zero-weight dummy changes nothing
        results.append(t.finish_train_step())
    got = t.export_weights()
    assert next(iter(got.values())).dtype == getattr(torch, config.runtime.dtype or "float32")
    assert max_param_diff(got, want) <= weight_tolerance(config, len(batches))
    # the test can fail: one step moves the weights far more than the tolerance
    assert max_param_diff(initial, want) > 1e-3
    rel, abs_ = metric_tolerance(config)
    for r, w in zip(results, want_results):
        assert r.grad_norm == pytest.approx(w.grad_norm, rel=rel)
        assert r.num_tokens == w.num_tokens and r.num_sequences == w.num_sequences
        assert r.num_microbatches == len(PARTITIONS[partition])
        assert r.metrics.keys() == w.metrics.keys()
        for name in w.metrics:
            assert r.metrics[name] == pytest.approx(w.metrics[name], rel=rel, abs=abs_), name
    assert t.trainer_version == 2


def test_normaliser_is_the_global_count_not_the_microbatch_count():
    # Per-microbatch means averaged would weigh the 1-row microbatch like the 7-row one.
    batch = make_batch(12)
    t = TorchTrainer(FACTORY, *SGD)
    t.begin_train_step(0, TOKEN)
    r1 = t.train_microbatch(batch.select(slice(0, 1)))
    r2 = t.train_microbatch(batch.select(slice(1, 8)))
    res = t.finish_train_step()
    assert res.num_tokens == r1.num_tokens + r2.num_tokens == batch.num_tokens
    assert res.metrics["num_tokens"] == batch.num_tokens  # a COUNT is never divided
    assert (r1.index, r2.index) == (0, 1)


def test_lr_reported_is_the_one_used_for_this_step():
    config = SGD.with_train(warmup_steps=4)
    t = TorchTrainer(FACTORY, *config)
    lrs = [t.train(make_batch(20 + s), TOKEN).lr for s in range(5)]
    assert lrs == pytest.approx([0.5 * k / 4 for k in (1, 2, 3, 4, 4)])


# -- metric normalisation rules ------------------------------------------------------


def test_each_metric_is_normalised_by_its_own_kind():
    acc = MetricAccumulator()
    for tok_sum, seq_sum, mn, mx in ((3.0, 1.0, 0.5, 2.0), (5.0, 3.0, 0.2, 1.0)):
        acc.add(
            {
                "t": Metric(torch.tensor(tok_sum), MetricKind.TOKEN),
                "s": Metric(torch.tensor(seq_sum), MetricKind.SEQUENCE),
                "l": Metric(torch.tensor(seq_sum), MetricKind.LOSS),
                "c": Metric(torch.tensor(2.0), MetricKind.COUNT),
                "lo": Metric(torch.tensor(mn), MetricKind.MIN),
                "hi": Metric(torch.tensor(mx), MetricKind.MAX),
                "aux_loss": torch.tensor(tok_sum),  # untagged, unknown name
                "ratio_max": 7.0,  # untagged, known name
            }
        )
    rank0 = acc.stats(num_sequences=4, num_tokens=10, num_microbatches=2, num_dummy=0)
    rank1 = MetricAccumulator()
    rank1.add(
        {
            "lo": Metric(torch.tensor(0.1), MetricKind.MIN),
            "c": Metric(torch.tensor(1.0), MetricKind.COUNT),
        }
    )
    total = combine([rank0, rank1.stats(1, 6, 1, 1)])
    for agg, loss_n in ((Aggregation.TOKEN, 16), (Aggregation.SEQUENCE, 5)):
        m = normalise(total, agg)
        assert m["t"] == pytest.approx(8.0 / 16)
        assert m["s"] == pytest.approx(4.0 / 5)
        assert m["l"] == pytest.approx(4.0 / loss_n)
        assert m["c"] == 5.0
        assert m["lo"] == pytest.approx(0.1) and m["hi"] == 2.0
        assert m["aux_loss"] == pytest.approx(8.0 / loss_n)  # defaulted to LOSS
        assert m["ratio_max"] == 7.0
    assert total.num_dummy_microbatches == 1 and total.num_microbatches == 3


def test_unknown_metric_defaults_to_loss_kind():
    assert DEFAULT_KIND is MetricKind.LOSS
    assert kind_of("some_aux_loss") is MetricKind.LOSS
    assert kind_of("num_tokens") is MetricKind.COUNT


def test_conflicting_metric_kinds_are_an_error():
    acc = MetricAccumulator()
    acc.add({"x": Metric(torch.tensor(1.0), MetricKind.MIN)})
    with pytest.raises(ValueError, match="'x'"):
        acc.add({"x": Metric(torch.tensor(1.0), MetricKind.MAX)})


# -- abort, wrong order, failures ----------------------------------------------------


def test_abort_leaves_everything_bitwise_unchanged_and_is_idempotent():
    t = TorchTrainer(FACTORY, *ADAMW)
    t.train(make_batch(30), TOKEN)  # optimizer state exists
    before = snapshot(t)
    t.begin_train_step(1, SEQUENCE)
    for mb in split(make_batch(31), [5, 3]):
        t.train_microbatch(mb)
    torch.rand(3)  # the step (or anything) consumed randomness: abort restores it
    t.abort_train_step()
    t.abort_train_step()
    assert_same(snapshot(t), before)
    assert t.phase is StepPhase.IDLE


def test_step_after_abort_equals_step_without_the_aborted_one():
    a, b = TorchTrainer(FACTORY, *ADAMW), TorchTrainer(FACTORY, *ADAMW)
    a.begin_train_step(0, TOKEN)
    a.train_microbatch(make_batch(32))
    a.abort_train_step()
    ra, rb = a.train(make_batch(33), TOKEN), b.train(make_batch(33), TOKEN)
    assert ra.weights_digest == rb.weights_digest
    assert ra.trainer_version == rb.trainer_version == 1


@pytest.mark.parametrize(
    "calls, message",
    [
        (["train_microbatch"], "no open step"),
        (["finish_train_step"], "no open step"),
        (["begin", "begin"], "step 0 is open"),
        (["begin", "save_checkpoint"], "step 0 is open"),
    ],
)
def test_wrong_order_raises_state_error(tmp_path, calls, message):
    t = TorchTrainer(FACTORY, *SGD)
    digest = t.weights_digest()
    *setup, bad = calls
    for c in setup:
        t.begin_train_step(0, TOKEN)
    with pytest.raises(TrainStepStateError, match=message):
        if bad == "begin":
            t.begin_train_step(0, TOKEN)
        elif bad == "save_checkpoint":
            t.save_checkpoint(tmp_path / "ckpt")
        elif bad == "train_microbatch":
            t.train_microbatch(make_batch(1))
        else:
            getattr(t, bad)()
    assert t.weights_digest() == digest and t.trainer_version == 0
    t.abort_train_step()
    assert t.train(make_batch(34), TOKEN).trainer_version == 1


def test_exception_inside_a_step_then_abort_leaves_the_worker_usable():
    t, fresh = TorchTrainer(FACTORY, *ADAMW), TorchTrainer(FACTORY, *ADAMW)
    before = snapshot(t)
    t.begin_train_step(0, TOKEN)
    t.train_microbatch(make_batch(35))
    too_long = make_batch(36, max_len=40)  # exceeds the model's context: forward raises
    with pytest.raises(ValueError, match="context_len"):
        t.train_microbatch(too_long)
    assert t.phase is StepPhase.FAILED
    with pytest.raises(TrainStepStateError, match="failed .*ValueError.*abort_train_step"):
        t.finish_train_step()
    with pytest.raises(TrainStepStateError):
        t.begin_train_step(1, TOKEN)
    t.abort_train_step()
    assert_same(snapshot(t), before)
    after = t.train(make_batch(37), TOKEN).weights_digest
    assert after == fresh.train(make_batch(37), TOKEN).weights_digest


def test_oneshot_train_aborts_its_own_step_on_failure():
    t = TorchTrainer(FACTORY, *SGD)
    with pytest.raises(ValueError):
        t.train(make_batch(38, max_len=40), TOKEN)
    assert t.phase is StepPhase.IDLE and t.trainer_version == 0


def test_a_step_without_loss_bearing_tokens_is_an_empty_step_not_an_error():
    """No valid token on any rank: the step finishes (the controller's loop would retry
    a failing one forever) with a zero gradient, no update, and says so in a metric."""
    t = TorchTrainer(FACTORY, *ADAMW)
    t.train(make_batch(37), TOKEN)  # Adam has momentum now: a skipped update is visible
    before = snapshot(t)
    empty = make_batch(38)
    empty = replace(empty, loss_mask=torch.zeros_like(empty.loss_mask))
    t.begin_train_step(1, SEQUENCE)
    t.train_microbatch(None)
    t.train_microbatch(empty)
    result = t.finish_train_step()
    assert result.trainer_version == 2 and t.phase is StepPhase.IDLE
    assert result.metrics["empty_step"] == 1.0 and result.grad_norm == 0.0
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert (result.num_tokens, result.num_sequences) == (0, 0)
    after = snapshot(t)
    assert_same(after["weights"], before["weights"])
    assert_same(after["optimizer"], before["optimizer"])


def test_non_finite_gradient_raises_and_applies_no_update():
    t = TorchTrainer(FACTORY, *ADAMW)
    before = snapshot(t)
    batch = make_batch(39)
    bad = replace(batch, advantages=torch.full_like(batch.advantages, math.inf))
    with pytest.raises(NonFiniteGradientError):
        t.train(bad, TOKEN)
    assert_same(snapshot(t), before)


# -- logprobs, reference model, weights export ---------------------------------------


def test_compute_logprobs_policy_and_reference():
    t = TorchTrainer(FACTORY, *ADAMW)
    batch = make_batch(40)
    policy0 = t.compute_logprobs(batch, "policy", temperature=0.8)
    assert policy0.shape == batch.loss_mask.shape and policy0.dtype == torch.float32
    assert torch.all(policy0[~batch.loss_mask] == 0) and torch.all(policy0[batch.loss_mask] < 0)
    assert torch.equal(policy0, t.compute_logprobs(batch, "reference", temperature=0.8))
    t.train(batch, TOKEN)
    assert not torch.equal(policy0, t.compute_logprobs(batch, "policy", temperature=0.8))
    assert torch.equal(policy0, t.compute_logprobs(batch, "reference", temperature=0.8))
    with pytest.raises(ValueError, match="which"):
        t.compute_logprobs(batch, "behaviour")


def test_internal_reference_equals_reference_logprobs_in_the_batch():
    a, b = TorchTrainer(FACTORY, *ADAMW), TorchTrainer(FACTORY, *ADAMW)
    batch = make_batch(41)
    a.train(make_batch(42), TOKEN)
    b.train(make_batch(42), TOKEN)
    ref = b.compute_logprobs(batch, "reference", temperature=SEQUENCE.sampling.temperature)
    ra = a.train(batch, SEQUENCE)
    rb = b.train(replace(batch, reference_logprobs=ref), SEQUENCE)
    assert ra.metrics["kl"] > 0
    assert ra.weights_digest == rb.weights_digest


def test_export_weights_is_a_detached_cpu_copy():
    t = TorchTrainer(FACTORY, *SGD)
    w = t.export_weights()
    assert w.keys() == t.model.state_dict().keys()
    assert all(v.device.type == "cpu" for v in w.values())
    digest = t.weights_digest()
    for v in w.values():
        v.add_(1.0)
    assert t.weights_digest() == digest


# -- the step state machine under random call sequences ------------------------------


class SplitApiMachine(RuleBasedStateMachine):
    """Random call orders: wrong ones raise and change nothing, right ones advance."""

    @initialize()
    def setup(self):
        self.t = TorchTrainer(FACTORY, *SGD.with_runtime(digest_on_finish=True))
        self.open = False
        self.has_data = False
        self.version = 0
        self.digest = self.t.weights_digest()

    @rule()
    def begin(self):
        if self.open:
            with pytest.raises(TrainStepStateError):
                self.t.begin_train_step(self.version, TOKEN)
        else:
            self.t.begin_train_step(self.version, TOKEN)
            self.open, self.has_data = True, False

    @rule(seed=st.integers(0, 3), dummy=st.booleans())
    def microbatch(self, seed, dummy):
        if not self.open:
            with pytest.raises(TrainStepStateError):
                self.t.train_microbatch(None)
            return
        self.t.train_microbatch(None if dummy else make_batch(seed, batch_size=2))
        self.has_data |= not dummy

    @rule()
    def finish(self):
        if not self.open:
            with pytest.raises(TrainStepStateError):
                self.t.finish_train_step()
        elif not self.has_data:  # an empty step: the version moves, the weights do not
            res = self.t.finish_train_step()
            self.version += 1
            self.open = False
            assert res.trainer_version == self.version and res.metrics["empty_step"] == 1.0
            assert res.weights_digest == self.digest
        else:
            res = self.t.finish_train_step()
            self.version += 1
            self.open = False
            assert res.trainer_version == self.version
            self.digest = res.weights_digest

    @rule()
    def abort(self):
        self.t.abort_train_step()
        self.open = False

    @invariant()
    def consistent(self):
        assert self.t.trainer_version == self.version
        assert self.t.phase is (StepPhase.OPEN if self.open else StepPhase.IDLE)
        assert self.t.weights_digest() == self.digest


SplitApiMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=12, deadline=None
)
TestSplitApiStateMachine = SplitApiMachine.TestCase


# -- any causal LM: outputs with ``.logits`` (Hugging Face style) ----------------------


@dataclass(frozen=True)
class HFGPT2Factory:
    """A randomly initialised Hugging Face GPT-2 built from a config (no download)."""

    def __call__(self) -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=16, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        return GPT2LMHeadModel(cfg)


@pytest.mark.slow
def test_hugging_face_module_with_logits_output_trains_split_equal_oneshot():
    pytest.importorskip("transformers")
    a, b = TorchTrainer(HFGPT2Factory(), *SGD64), TorchTrainer(HFGPT2Factory(), *SGD64)
    initial = a.export_weights()
    batch = make_batch(60)
    a.train(batch, TOKEN)
    b.begin_train_step(0, TOKEN)
    for mb in split(batch, [5, 3]):
        b.train_microbatch(mb)
    b.finish_train_step()
    assert max_param_diff(a.export_weights(), b.export_weights()) <= weight_tolerance(SGD64, 1)
    assert max_param_diff(initial, a.export_weights()) > 1e-3
    assert a.trainer_version == b.trainer_version == 1
