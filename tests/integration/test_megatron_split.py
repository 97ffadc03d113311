"""Megatron backend at world size 1 (in-process, one-rank gloo group): the split API's
gradient path -- one reduction per step, the sync hooks, abort, MoE aux losses.

The regression tests here fail if ``finish_train_step`` dispatches the gradient sync
twice (``start_grad_sync`` *and* ``finish_grad_sync`` with overlap off: gradients x
world size -- invisible numerically at world size 1, so the collectives are counted),
or if ``config.no_sync_func`` / ``grad_sync_func`` stay set during a step or are not
restored after it (a finish, an abort, an exception).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("megatron.core")

from tests.trainer_helpers import (  # noqa: E402
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
from workers.backends import BackendUnavailableError  # noqa: E402
from workers.trainer import StepPhase, TorchTrainer  # noqa: E402
from workers.trainer.megatron_backend import (  # noqa: E402
    McoreGPTFactory,
    MegatronOptions,
    MegatronTrainer,
)

pytestmark = pytest.mark.integration

OVERLAP = [False, True]

# This module is the gloo (CPU) suite: pin its trainers to the CPU, or a machine with a
# GPU would put them on CUDA under a gloo group ("unsupported device type cuda"). The
# GPU runs are test_megatron_dp2.py's ``gpu`` tests.
SGD, ADAMW, SGD64, ADAMW64 = (c.with_runtime(device="cpu") for c in (SGD, ADAMW, SGD64, ADAMW64))


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """Megatron's groups over a one-rank gloo group, torn down after the module."""
    from workers.trainer import megatron_shims

    created = not dist.is_initialized()
    megatron_shims.ensure_parallel_state()
    yield
    megatron_shims.destroy_parallel_state()
    if created:
        dist.destroy_process_group()


def ddp(t):
    """The rank's mcore ``DistributedDataParallel`` (what its microbatches run through)."""
    return t.parallel.forward


def train_split(t, batch, loss, sizes, step=0):
    t.begin_train_step(step, loss)
    for mb in split(batch, sizes):
        t.train_microbatch(mb)
    return t.finish_train_step()


# -- parity -------------------------------------------------------------------------


#: float64 is the exactness check; float32 at its optimizer's tolerance (trainer_helpers)
CONFIGS = {"sgd64": SGD64, "adamw64": ADAMW64, "sgd32": SGD, "adamw32": ADAMW}


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("loss", [TOKEN, SEQUENCE], ids=["token", "sequence"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_split_matches_torch_backend_oneshot(config, loss, overlap):
    batches = [make_batch(10), make_batch(11)]
    want, want_results, initial = oneshot_reference(config, loss, batches)
    t = MegatronTrainer(FACTORY, *config, MegatronOptions(overlap_grad_reduce=overlap))
    assert max_param_diff(t.export_weights(), initial) == 0  # same init as the torch backend
    results = []
    for step, batch in enumerate(batches):
        t.begin_train_step(step, loss)
        for i, mb in enumerate(split(batch, [3, 1, 4])):
            t.train_microbatch(mb)
            if i == 0:
                t.train_microbatch(None)
        results.append(t.finish_train_step())
    assert max_param_diff(t.export_weights(), want) <= weight_tolerance(config, len(batches))
    assert max_param_diff(initial, want) > 1e-3
    rel, abs_ = metric_tolerance(config)
    for r, w in zip(results, want_results):
        assert r.grad_norm == pytest.approx(w.grad_norm, rel=rel)
        assert r.lr == w.lr and r.num_tokens == w.num_tokens and r.num_microbatches == 3
        for name in w.metrics:
            assert r.metrics[name] == pytest.approx(w.metrics[name], rel=rel, abs=abs_), name


def test_mcore_gpt_model_split_matches_oneshot():
    factory = McoreGPTFactory(
        vocab_size=16, context_len=16, hidden_size=32, num_layers=2, num_attention_heads=2
    )
    a, b = MegatronTrainer(factory, *SGD64), MegatronTrainer(factory, *SGD64)
    initial = a.export_weights()
    batch = make_batch(12)
    ra = a.train(batch, SEQUENCE)
    rb = train_split(b, batch, SEQUENCE, [5, 1, 2])
    assert max_param_diff(a.export_weights(), b.export_weights()) <= weight_tolerance(SGD64, 1)
    assert max_param_diff(initial, a.export_weights()) > 1e-3
    assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=metric_tolerance(SGD64)[0])


# -- exactly one reduction per step ----------------------------------------------------


@contextlib.contextmanager
def count_grad_reductions(trainer):
    """Count collectives issued on the DDP gradient buffers while the block runs."""
    buffers = {b.grad_data.data_ptr() for b in ddp(trainer).buffers}
    calls: list[int] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor")}

    def counting(name):
        def call(tensor, *args, **kwargs):
            target = tensor if name == "all_reduce" else args[0]
            if target.data_ptr() in buffers:
                calls.append(1)
            return originals[name](tensor, *args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_finish_reduces_gradients_exactly_once(overlap):
    t = MegatronTrainer(FACTORY, *SGD, MegatronOptions(overlap_grad_reduce=overlap))
    for step in range(2):
        t.begin_train_step(step, TOKEN)
        with count_grad_reductions(t) as calls:
            for mb in split(make_batch(13 + step), [4, 4]):
                t.train_microbatch(mb)
        assert calls == [], "a microbatch communicated"
        with count_grad_reductions(t) as calls:
            t.finish_train_step()
        assert len(calls) == 1, f"finish reduced the gradients {len(calls)} times"


class Probe:
    """Records the DDP config's sync hooks every time the model runs forward."""

    def __init__(self, config) -> None:
        self.config = config
        self.seen: list = []

    def __call__(self, module, args):
        self.seen.append((self.config.no_sync_func, self.config.grad_sync_func))


def _install_probe(t) -> Probe:
    probe = Probe(ddp(t).config)
    t.model.register_forward_pre_hook(probe)
    return probe


def _sentinel_hooks(t):
    @contextlib.contextmanager
    def no_sync():
        yield

    def grad_sync(*unused):
        raise AssertionError("grad_sync_func was called during a split step")

    ddp(t).config.no_sync_func, ddp(t).config.grad_sync_func = no_sync, grad_sync
    return no_sync, grad_sync


@pytest.mark.parametrize("ending", ["finish", "abort", "exception", "failed_finish"])
def test_sync_hooks_are_null_during_a_step_and_restored_after(ending):
    t = MegatronTrainer(FACTORY, *SGD, MegatronOptions(overlap_grad_reduce=True))
    no_sync, grad_sync = _sentinel_hooks(t)
    probe = _install_probe(t)
    t.begin_train_step(0, TOKEN)
    t.train_microbatch(make_batch(14))
    assert probe.seen == [(None, None)], "hooks still set inside the step"
    if ending == "finish":
        t.finish_train_step()
    elif ending == "abort":
        t.abort_train_step()
    elif ending == "exception":
        with pytest.raises(ValueError, match="context_len"):
            t.train_microbatch(make_batch(15, max_len=40))
        assert t.phase is StepPhase.FAILED
    else:
        t.abort_train_step()
        t.begin_train_step(0, SEQUENCE)
        t.train_microbatch(None)
        assert t.finish_train_step().metrics["empty_step"] == 1.0  # no token: no update
    assert ddp(t).config.no_sync_func is no_sync and ddp(t).config.grad_sync_func is grad_sync
    t.abort_train_step()
    t.abort_train_step()  # idempotent: still the caller's hooks
    assert ddp(t).config.no_sync_func is no_sync and ddp(t).config.grad_sync_func is grad_sync


def test_no_grad_ready_counts_leak_into_later_steps_with_overlap():
    # A microbatch run outside no_sync with overlap on would count "grad ready" events;
    # zero_grad_buffer would keep them as the golden set, and later steps would dispatch
    # a reduction mid-step (then assert on the second dispatch).
    t = MegatronTrainer(FACTORY, *ADAMW, MegatronOptions(overlap_grad_reduce=True))
    for step in range(3):
        train_split(t, make_batch(16 + step), TOKEN, [2, 6], step)
        assert ddp(t).bucket_groups, "overlap_grad_reduce builds bucket groups; none to check"
        for group in ddp(t).bucket_groups:
            assert group.per_param_grad_ready_counts == {}
            assert group.golden_per_param_grad_ready_counts == {}
            assert group.grad_reduce_handle is None


# -- abort -------------------------------------------------------------------------------


def test_abort_leaves_weights_optimizer_and_buffers_unchanged():
    t, fresh = MegatronTrainer(FACTORY, *ADAMW), MegatronTrainer(FACTORY, *ADAMW)
    t.train(make_batch(30), TOKEN)
    fresh.train(make_batch(30), TOKEN)
    digest, version = t.weights_digest(), t.trainer_version
    t.begin_train_step(1, SEQUENCE)
    for mb in split(make_batch(31), [5, 3]):
        t.train_microbatch(mb)
    t.abort_train_step()
    t.abort_train_step()
    assert t.weights_digest() == digest and t.trainer_version == version
    assert all(float(b.grad_data.abs().sum()) == 0 for b in ddp(t).buffers)
    assert t.train(make_batch(33), TOKEN).weights_digest == fresh.train(
        make_batch(33), TOKEN
    ).weights_digest


def test_distributed_optimizer_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(BackendUnavailableError, match="distributed optimizer needs a CUDA GPU"):
        MegatronTrainer(FACTORY, *ADAMW, MegatronOptions(use_distributed_optimizer=True))


# -- MoE auxiliary losses ----------------------------------------------------------------


class AuxLossLM(nn.Module):
    """The tiny LM plus a router-style aux loss attached through MoEAuxLossAutoScaler."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = FACTORY()
        self.router = nn.Linear(FACTORY.config.vocab_size, 4)

    def forward(self, input_ids):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        logits = self.lm(input_ids)
        aux = 0.1 * self.router(logits).pow(2).mean()
        return MoEAuxLossAutoScaler.apply(logits, aux)


@dataclass(frozen=True)
class AuxLossFactory:
    def __call__(self) -> nn.Module:
        return AuxLossLM()


def test_moe_aux_loss_is_scaled_by_the_global_microbatch_count():
    from workers.loss import grpo_loss, token_logprobs
    from workers.trainer.tensors import _trim

    sgd = SGD64.with_train(lr=1.0).with_runtime(keep_reference=False)
    t = MegatronTrainer(AuxLossFactory(), *sgd)
    model = AuxLossFactory()().double()
    model.load_state_dict(t.model.state_dict())
    batch, sizes = make_batch(40), [3, 2, 3]
    res = train_split(t, batch, TOKEN, sizes)
    # expected gradient: sum of raw GRPO sums / N  +  mean over microbatches of aux loss
    total = 0.0
    for mb in split(batch, sizes):
        mb = _trim(mb, torch.device("cpu"))  # the trainer drops all-padding columns
        aux: list[torch.Tensor] = []
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        original = MoEAuxLossAutoScaler.apply
        MoEAuxLossAutoScaler.apply = lambda out, a: (aux.append(a), out)[1]
        try:
            logits = model(mb.input_ids)
        finally:
            MoEAuxLossAutoScaler.apply = original
        lp = token_logprobs(logits, mb.input_ids, TOKEN.sampling.temperature)
        pg = grpo_loss(lp, mb, TOKEN.options).loss_sum
        total = total + pg / res.num_tokens + aux[0] / len(sizes)
    total.backward()
    want = {k: (p - p.grad).detach() for k, p in model.named_parameters()}
    got = t.export_weights()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= weight_tolerance(sgd, 1)
    assert float(model.router.weight.grad.abs().max()) > 1e-4  # the aux term is visible


# -- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_layout_is_the_torch_backends(tmp_path):
    torch_trainer = TorchTrainer(FACTORY, *ADAMW64)
    torch_trainer.train(make_batch(50), TOKEN)
    torch_trainer.save_checkpoint(tmp_path / "from-torch")
    m = MegatronTrainer(FACTORY, *ADAMW64)
    info = m.load_checkpoint(tmp_path / "from-torch")
    assert info.trainer_version == 1 and m.weights_digest() == torch_trainer.weights_digest()
    rm, rt = m.train(make_batch(51), TOKEN), torch_trainer.train(make_batch(51), TOKEN)
    tolerance = weight_tolerance(ADAMW64, 1)
    assert max_param_diff(m.export_weights(), torch_trainer.export_weights()) <= tolerance
    assert rm.trainer_version == rt.trainer_version == 2
    m.save_checkpoint(tmp_path / "from-megatron")
    again = MegatronTrainer(FACTORY, *ADAMW64)
    again.load_checkpoint(tmp_path / "from-megatron")
    assert again.weights_digest() == m.weights_digest()


# -- megatron's distributed optimizer: what it can build -----------------------------------


def test_distributed_optimizer_only_where_megatron_builds_it():
    # megatron-core 0.16's distributed optimizer takes AdamW on float32/bf16/fp16 only
    # (an H100 run refused SGD and float64): the CUDA default falls back to the torch
    # optimizer there, and asking for it is refused by name before anything is built.
    from workers.trainer.megatron_backend import _distributed_optimizer

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _distributed_optimizer(None, cuda, ADAMW.runtime) is True
    assert _distributed_optimizer(None, cuda, SGD.runtime) is False
    assert _distributed_optimizer(None, cuda, ADAMW64.runtime) is False
    assert _distributed_optimizer(None, cpu, ADAMW.runtime) is False
    assert _distributed_optimizer(False, cuda, ADAMW.runtime) is False
    for cfg, named in ((SGD, "optimizer 'sgd'"), (ADAMW64, "float64 parameters")):
        with pytest.raises(BackendUnavailableError, match=named):
            MegatronTrainer(FACTORY, *cfg, MegatronOptions(use_distributed_optimizer=True))
