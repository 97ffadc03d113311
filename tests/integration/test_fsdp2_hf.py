"""FSDP2 with a Hugging Face Llama (tied embeddings) from a local directory, float64.

* world size 1 in this process: the tied input/output embedding is one parameter
  after sharding and after training; the digest equals the torch backend's; a split
  step equals the torch backend's one-shot;
* tensor parallel 2 (dp 1, tp 2; two gloo processes): the DTensor plan of
  ``workers.trainer.fsdp2_tp`` over HF Llama blocks gives the torch backend's one-shot
  weights within 1e-12, with and without the KL term. The step counts are taken over
  dp ranks only: counting both tp ranks would halve every gradient, and this fails;
* dp 2 x tp 2 (four gloo processes, a 2-D mesh): the same truth, each dp index's two
  tp ranks training the same half of every batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp2_helpers import CONFIGS, F64, LOSSES, TOL, DoubleFactory, batches, hf_factory, max_diff, spawn
from tests.hf_fixture import save_tiny_hf_lm
from tests.trainer_helpers import SGD, TOKEN, split

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(save_tiny_hf_lm(tmp_path_factory.mktemp("llama"), "llama", tie=True))


@pytest.fixture
def world1():
    import torch.distributed as dist

    from workers.trainer.fsdp2_shard import ensure_process_group

    ensure_process_group()
    yield
    dist.destroy_process_group()


def torch_truth(path: str, cfg_name: str, loss_name: str):
    from workers.trainer.torch_backend import TorchTrainer

    t = TorchTrainer(DoubleFactory(hf_factory(path)), *CONFIGS[cfg_name])
    for b in batches():
        t.train(b, LOSSES[loss_name])
    return t


def test_tied_embeddings_stay_tied_and_match_the_torch_backend(llama_dir, world1):
    from workers.trainer.fsdp2_backend import Fsdp2Trainer
    from workers.trainer.torch_backend import TorchTrainer

    t = Fsdp2Trainer(hf_factory(llama_dir), *SGD, F64)
    lm = t.model.model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    ref = TorchTrainer(DoubleFactory(hf_factory(llama_dir)), *SGD)
    assert t.weights_digest() == ref.weights_digest()  # meta ranks + broadcast, buffers too
    batch = batches()[0]
    t.begin_train_step(0, TOKEN)
    for mb in split(batch, [5, 3]):
        t.train_microbatch(mb)
    t.finish_train_step()
    ref.train(batch, TOKEN)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    w = t.export_weights()
    assert torch.equal(w["model.lm_head.weight"], w["model.model.embed_tokens.weight"])
    assert max_diff(w, ref.export_weights()) <= TOL
    assert t.weights_digest() != ref.export_weights() and t.trainer_version == 1


@pytest.mark.parametrize("world", [2, 4], ids=["dp1xtp2", "dp2xtp2"])
def test_tensor_parallel_2_matches_torch_oneshot(llama_dir, tmp_path, world):
    ranks = spawn(world, tmp_path, [f"hf_tp2:{llama_dir}"])
    for key, (weights, digest) in ranks[0]["hf_tp"].items():
        assert all(r["hf_tp"][key][1] == digest for r in ranks[1:])
        assert all(r["hf_tp"][key][0] == {} for r in ranks[1:]), "only rank 0 keeps weights"
        truth = torch_truth(llama_dir, *key)
        assert max_diff(weights, truth.export_weights()) <= TOL, key
