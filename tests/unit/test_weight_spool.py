"""A refit's staging memory in the generator is bounded by the bucket, not the model.

Measured with ``tracemalloc``: every bucket a generator receives is a Python ``bytes``
object (from Ray, or handed over in-process), so a receiver that kept one version's
buckets until loading it would show the model's size in traced memory. Spooled, the
traced peak over a whole refit -- sender's bucket, receiver, loading -- stays within a
few buckets, and while a version waits for a group to end it holds about nothing in
memory. (Tensor storage is torch's, not traced; what is loaded goes straight into the
model's own parameters, one tensor at a time.)
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import pytest
import torch

from workers.models.config import ModelSection
from workers.models.factory import build_model
from workers.weight_spool import BucketSpool, SpooledBuckets
from workers.weight_sync import BucketReceiver, VersionedWeights, cpu_state_dict, load_tensors
from workers.weight_transport import RefitSource

BUCKET = 4096
#: a few buckets, plus bookkeeping that does not grow with tensor sizes (offsets, the
#: model's state-dict index, thread and lock objects; measured ~50 KB here)
BOUND = 4 * BUCKET + 64 * 1024


def test_spool_reads_back_what_was_written_and_leaves_no_file():
    blobs = [os.urandom(n) for n in (10, 0, 5000, 1)]
    before = set(os.listdir(d := os.path.realpath(__import__("tempfile").gettempdir())))
    with BucketSpool() as spool:
        for b in blobs:
            spool.append(b)
        sealed = spool.sealed()
        assert list(sealed) == blobs and len(sealed) == 4 and sealed.nbytes == 5011
        # another reader (a vLLM engine process) gets only the path and the spans
        assert list(SpooledBuckets(sealed.path, sealed.spans)) == blobs
        assert not [n for n in set(os.listdir(d)) - before if n.startswith("rlc-refit-")]
    with pytest.raises(OSError):
        list(sealed)  # closed: the file is gone with its descriptor


def _sender(seed: int) -> tuple[RefitSource, dict[str, torch.Tensor]]:
    trained, _ = build_model(ModelSection(context_len=64), seed)
    weights = cpu_state_dict(trained)
    return RefitSource(lambda: weights), weights


def _buckets(source: RefitSource, version: int) -> list[bytes]:
    """The sender's side, made before tracing (its serializer's garbage is not ours)."""
    count = source.prepare_weight_buckets(version, BUCKET)
    return [source.weight_bucket(version, index) for index in range(count)]


def _send(blobs: list[bytes], receiver: BucketReceiver, version: int) -> None:
    for index, blob in enumerate(blobs):
        # a fresh object per call, as a bucket fetched from Ray's object store is
        receiver.receive(version, index, len(blobs), bytes(memoryview(blob)))


def _model_bytes(weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def test_refit_peak_staged_memory_is_a_few_buckets_not_the_model():
    model, _ = build_model(ModelSection(context_len=64))
    receiver = BucketReceiver(VersionedWeights(model, "g0"))
    _send(_buckets(_sender(seed=6)[0], 1), receiver, 1)  # warm: imports, type caches
    source, want = _sender(seed=7)
    blobs = _buckets(source, 2)
    assert _model_bytes(want) > 4 * BOUND and len(blobs) > 50  # kept whole, it would show
    tracemalloc.start()
    try:
        _send(blobs, receiver, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= BOUND, f"refit peak {peak} bytes for {BUCKET}-byte buckets"
    assert receiver.weights.version == 2
    for name, value in cpu_state_dict(model).items():
        assert torch.equal(value, want[name]), name


def test_a_version_waiting_for_a_group_to_end_waits_on_disk():
    model, _ = build_model(ModelSection(context_len=64))
    weights = VersionedWeights(model, "g0")
    receiver = BucketReceiver(weights)
    _send(_buckets(_sender(seed=6)[0], 1), receiver, 1)  # warm, as above
    source, want = _sender(seed=8)
    blobs = _buckets(source, 3)
    started, finish = threading.Event(), threading.Event()

    def group() -> None:  # the generating thread: the update must wait for its end
        weights.begin_group()
        started.set()
        finish.wait(60)
        weights.end_group()

    generating = threading.Thread(target=group)
    generating.start()
    started.wait(60)
    tracemalloc.start()
    try:
        sending = threading.Thread(target=_send, args=(blobs, receiver, 3))
        sending.start()
        deadline = time.monotonic() + 60
        while weights._pending is None:  # the whole version received, now waiting
            assert time.monotonic() < deadline and sending.is_alive()
            time.sleep(0.01)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        finish.set()
        generating.join(60)
        sending.join(60)
    assert held <= BOUND, f"{held} bytes held while a version waits"
    assert weights.version == 3
    assert all(torch.equal(v, want[k]) for k, v in cpu_state_dict(model).items())


def test_streamed_load_is_strict_like_load_state_dict():
    model, _ = build_model(ModelSection(context_len=64))
    sd = cpu_state_dict(model)
    name = next(iter(sd))
    with pytest.raises(ValueError, match="missing"):
        load_tensors(model, list(sd.items())[1:])
    with pytest.raises(ValueError, match="unexpected"):
        load_tensors(model, [("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="repeated"):
        load_tensors(model, [(name, sd[name]), (name, sd[name])])
    with pytest.raises(ValueError, match="shape"):
        load_tensors(model, [(name, torch.zeros(3, 3, 3, 3))])
