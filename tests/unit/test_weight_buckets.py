"""Refit buckets: any state dict survives the cut into bounded buckets, byte for byte."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.dataplane import MemoryDataPlane
from workers.generator.generator import Generator
from workers.handles import LocalHandle
from workers.models.config import ModelSection
from workers.models.factory import build_model
from workers.tasks import make_task
from workers.weight_buckets import iter_buckets, plan_buckets, unpack_buckets
from workers.weight_sync import StaleWeightsError, cpu_state_dict
from workers.weight_transport import BucketTransport, RefitSource

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


@st.composite
def state_dicts(draw):
    n = draw(st.integers(1, 6))
    out = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        out[f"layer{i}.w"] = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) * (i + 1)).to(dtype).reshape(shape)
    return out


@settings(max_examples=60, deadline=None)
@given(state_dicts(), st.integers(8, 200))
def test_round_trip_is_exact_and_every_bucket_is_bounded(sd, bucket_bytes):
    plan = plan_buckets(sd, bucket_bytes)
    for pieces in plan:
        assert sum(p.numel * sd[p.name].element_size() for p in pieces) <= bucket_bytes
    got = dict(unpack_buckets(iter_buckets(sd, bucket_bytes)))
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t)


def test_a_tensor_larger_than_a_bucket_is_split_and_reassembled():
    sd = {"big": torch.randn(100, 10), "small": torch.randn(3)}
    blobs = list(iter_buckets(sd, 1000))  # 4000 bytes of "big" -> at least 4 buckets
    assert len(blobs) >= 5
    got = dict(unpack_buckets(blobs))
    assert torch.equal(got["big"], sd["big"]) and torch.equal(got["small"], sd["small"])


def test_missing_bucket_is_an_error_not_a_partial_load():
    blobs = list(iter_buckets({"big": torch.randn(100)}, 100))
    with pytest.raises(ValueError, match="incomplete"):
        dict(unpack_buckets(blobs[:-1]))
    with pytest.raises(ValueError, match="out of order"):
        dict(unpack_buckets(blobs[1:]))


def test_bucket_transport_refits_generators_and_acks_the_version():
    cfg = ModelSection(context_len=64)
    trained, _ = build_model(cfg, 7)
    gens = []
    for i in range(2):
        model, tok = build_model(cfg)
        gens.append(Generator(model, tok, make_task("reverse"), MemoryDataPlane(), "r", name=f"g{i}"))
    trainer = LocalHandle(RefitSource(lambda: cpu_state_dict(trained)))
    handles = [LocalHandle(g, threads=2) for g in gens]
    transport = BucketTransport(bucket_bytes=4096)  # the tiny model is ~450 KB: many buckets

    acks = asyncio.run(transport.send(3, trainer, handles))
    assert [(a.generator, a.version) for a in acks] == [("g0", 3), ("g1", 3)]
    want = cpu_state_dict(trained)
    for g in gens:
        assert g.weight_version == 3
        for k, v in cpu_state_dict(g.model).items():
            assert torch.equal(v, want[k]), k
    with pytest.raises(StaleWeightsError):
        asyncio.run(transport.send(2, trainer, handles[:1]))
