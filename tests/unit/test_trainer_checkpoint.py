"""Checkpoints (atomic, verified, bitwise resumable) and cross-process determinism."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.trainer import (
    CheckpointCorruptError,
    CheckpointError,
    TorchTrainer,
    TrainStepStateError,
)
from workers.trainer.checkpoint import MANIFEST_NAME, staging_dir
from workers.trainer.torch_backend import digest_parameters
from tests.trainer_helpers import ADAMW, FACTORY, SEQUENCE, TOKEN, make_batch, split

REPO_ROOT = Path(__file__).resolve().parents[2]


def split_step(t: TorchTrainer, step: int, seed: int) -> str:
    t.begin_train_step(step, SEQUENCE if step % 2 else TOKEN)
    for mb in split(make_batch(seed), [2, 6]):
        t.train_microbatch(mb)
    return t.finish_train_step().weights_digest


def trained(steps: int) -> TorchTrainer:
    t = TorchTrainer(FACTORY, *ADAMW)
    for s in range(steps):
        split_step(t, s, 50 + s)
    return t


def test_load_then_step_equals_step_without_save_load(tmp_path):
    a = trained(2)
    info = a.save_checkpoint(tmp_path / "v2")
    assert info.trainer_version == 2 and info.step == 1
    want = split_step(a, 2, 52)

    b = TorchTrainer(FACTORY, *ADAMW.with_runtime(seed=ADAMW.runtime.seed))
    b.train(make_batch(99), TOKEN)  # diverge first: load must overwrite everything
    loaded = b.load_checkpoint(tmp_path / "v2")
    assert loaded.sha256 == info.sha256 and b.trainer_version == 2
    assert split_step(b, 2, 52) == want
    assert b.trainer_version == a.trainer_version == 3
    state_a = a.optimizer.state_dict()["state"]
    state_b = b.optimizer.state_dict()["state"]
    for pa, pb in zip(state_a.values(), state_b.values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_manifest_lists_sha256_of_every_file(tmp_path):
    t = trained(1)
    info = t.save_checkpoint(tmp_path / "ckpt")
    d = Path(info.path)
    manifest_bytes = (d / MANIFEST_NAME).read_bytes()
    manifest = json.loads(manifest_bytes)
    assert info.sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "scheduler.pt", "rng_rank0.pt"}
    for name, sha in manifest["files"].items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == sha
    assert manifest["meta"]["weights_digest"] == t.weights_digest()
    assert not staging_dir(d).exists()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _flip_byte(d / "model.pt"), "sha256 of model.pt"),
        (lambda d: _flip_byte(d / "optimizer.pt"), "sha256 of optimizer.pt"),
        (lambda d: (d / "scheduler.pt").unlink(), "scheduler.pt is missing"),
        (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "unreadable manifest"),
        (lambda d: (d / MANIFEST_NAME).unlink(), "unreadable manifest"),
    ],
)
def test_corrupted_checkpoint_is_refused_and_changes_nothing(tmp_path, damage, message):
    trained(1).save_checkpoint(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    t = TorchTrainer(FACTORY, *ADAMW)
    digest = t.weights_digest()
    with pytest.raises(CheckpointCorruptError, match=message):
        t.load_checkpoint(tmp_path / "ckpt")
    assert t.weights_digest() == digest and t.trainer_version == 0


def test_save_refuses_existing_directory_and_open_step(tmp_path):
    t = trained(1)
    t.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="already exists"):
        t.save_checkpoint(tmp_path / "ckpt")
    t.begin_train_step(1, TOKEN)
    with pytest.raises(TrainStepStateError):
        t.load_checkpoint(tmp_path / "ckpt")
    t.abort_train_step()
    with pytest.raises(CheckpointError, match="does not exist"):
        t.load_checkpoint(tmp_path / "nope")


def test_stale_staging_directory_is_replaced(tmp_path):
    final = tmp_path / "ckpt"
    staging = staging_dir(final)
    staging.mkdir()
    (staging / "model.pt").write_bytes(b"half-written garbage")
    t = trained(1)
    t.save_checkpoint(final)
    TorchTrainer(FACTORY, *ADAMW).load_checkpoint(final)  # verifies cleanly
    assert not staging.exists()


def test_weights_digest_covers_names_dtypes_and_shapes():
    t = TorchTrainer(FACTORY, *ADAMW)
    base = t.weights_digest()
    assert base == digest_parameters(TorchTrainer(FACTORY, *ADAMW).model)
    assert base != digest_parameters(TorchTrainer(FACTORY, *ADAMW.with_runtime(seed=1)).model)
    assert base != digest_parameters(t.model.to(torch.float64))
    with torch.no_grad():
        t.model.to(torch.float32)
        assert t.weights_digest() == base
        next(t.model.parameters()).view(-1)[0] += 1e-7
    assert t.weights_digest() != base


@pytest.mark.slow
def test_same_calls_give_bitwise_equal_weights_in_two_processes():
    code = "from tests.trainer_helpers import determinism_run; determinism_run()"
    digests = [
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout.strip()
        for _ in range(2)
    ]
    assert len(digests[0]) == 64
    assert digests[0] == digests[1]
