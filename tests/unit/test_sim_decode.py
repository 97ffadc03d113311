"""sim.decode: a server's decode step time grows with the sequences it runs at once, and
the simulated groups still running speed up when others stop (exact, in float64)."""

from __future__ import annotations

import asyncio

import pytest

from controller.config import load_config
from events.memory_store import MemoryEventStore
from sim.clock import VirtualTimeLoop
from sim.decode import NIM_LLAMA31_8B_H100, DecodeCurve, LoadedDecode
from sim.harness import SimSpec, simulate
from sim.timings import Lognormal, SyntheticTimings

#: step times at 1, 3 and 5 sequences: every value below is exact in binary floats
CURVE = ((1, 1.0), (3, 2.0), (5, 6.0))


def test_the_step_time_is_linear_between_points_flat_below_and_extended_beyond():
    c = DecodeCurve(points=CURVE, servers=1, reference_sequences=1)
    assert [c.step(n) for n in (0, 0.5, 1, 2, 3, 4, 5)] == [1.0, 1.0, 1.0, 1.5, 2.0, 4.0, 6.0]
    assert c.step(7) == 10.0  # the last segment's slope, 2 per sequence


def test_speed_is_relative_to_the_reference_load_spread_over_the_servers():
    c = DecodeCurve(points=CURVE, servers=2, reference_sequences=4)  # step(4) = 4
    # fleet sequences -> per server -> step -> speed
    assert c.speed(8) == 1.0  # 4 per server: the reference
    assert c.speed(2) == 4.0  # 1 per server: a quarter of the step time
    assert c.speed(6) == 2.0  # 3 per server: step 2
    assert c.speed(10) == 4.0 / 6.0  # 5 per server: step 6, slower than the reference
    assert c.speed(0) == 4.0  # nobody runs: the floor (no group is charged for it)


def test_the_published_curve_is_the_nim_table_and_its_reference_is_a_full_verl_server():
    c = DecodeCurve(points=NIM_LLAMA31_8B_H100, servers=16, reference_sequences=256)
    assert c.step(250) == 16.14 and c.step(100) == 7.57
    assert c.step(256) == pytest.approx(16.14 + 6 * (16.14 - 12.65) / 50, rel=1e-15)
    assert c.speed(16 * 256) == 1.0
    # a lone sequence per server decodes 16.56 / 4.63 = 3.58x as fast as a full server
    assert c.speed(16) == pytest.approx((16.14 + 6 * 3.49 / 50) / 4.63, rel=1e-12)


@pytest.mark.parametrize("kwargs, says", [
    ({"points": ((1, 1.0),)}, "sim.decode.points: needs at least 2"),
    ({"points": ((2, 1.0), (2, 2.0))}, "sim.decode.points: sequences must be >= 1 and increasing"),
    ({"points": ((0, 1.0), (2, 2.0))}, "sim.decode.points: sequences must be >= 1 and increasing"),
    ({"points": ((1, 1.0), (2, 0.0))}, "sim.decode.points: step times must be > 0"),
    ({"servers": 0}, "sim.decode.servers: must be >= 1, got 0"),
    ({"reference_sequences": 0}, "sim.decode.reference_sequences: must be >= 1, got 0"),
])
def test_a_bad_curve_is_refused_naming_its_field(kwargs, says):
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        DecodeCurve(**{"points": CURVE, "servers": 1, "reference_sequences": 1, **kwargs})


def _work_clock_run(cancel_b: bool = False) -> list[tuple[str, float]]:
    """A (1 sequence, 10 s of work) starts at 0, B (1 sequence, 4 s) at 2; one sequence
    decodes at twice the reference speed, two at the reference."""
    loop = VirtualTimeLoop()
    clock = LoadedDecode(loop, DecodeCurve(points=((1, 1.0), (2, 2.0)), servers=1,
                                           reference_sequences=2))
    ended: list[tuple[str, float]] = []

    def end(name: str) -> None:
        clock.remove(1)
        ended.append((name, loop.time()))

    async def main() -> None:
        clock.add(1)
        clock.call_later(10.0, end, "A")
        await asyncio.sleep(2.0)
        clock.add(1)
        b = clock.call_later(4.0, end, "B")
        if cancel_b:
            await asyncio.sleep(1.0)
            b.cancel()
            clock.remove(1)
        await asyncio.sleep(100.0)

    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(main())
    return ended


def test_groups_still_running_speed_up_when_others_stop():
    # 0-2 s: A alone at 2x (4 s of work); 2-6 s: both at 1x, B ends with its 4 s; A has
    # 8 of 10 done and ends alone at 2x, 1 s later
    assert _work_clock_run() == [("B", 6.0), ("A", 7.0)]


def test_a_cancelled_deadline_never_fires_and_its_sequences_leave_the_load():
    # 0-2 s: 4 of A's work; 2-3 s both (5); then alone at 2x: 5 s of work in 2.5 s
    assert _work_clock_run(cancel_b=True) == [("A", 5.5)]


def _verl_like_run(decode: DecodeCurve | None, partial: bool) -> tuple[list, float]:
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=8", "rollout.groups_per_call=1",
        "rollout.samples_per_group=4", "train.groups_per_step=8", "train.groups_per_microbatch=4",
        "staleness.window_versions=1", "checkpoint.every_steps=5",
        *(["rollout.partial.enabled=true", "staleness.window_basis=newest_token"] if partial else ()),
    ])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               publish=2.0, seed=3)
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="d", decode=decode))
    events = list(store.read("d"))
    return [(type(s.event).__name__, getattr(s.event, "group_id", None)) for s in events], events[-1].event.ts


@pytest.mark.parametrize("partial", [False, True])
def test_a_flat_curve_is_the_model_without_load(partial):
    flat = DecodeCurve(points=((1, 3.0), (64, 3.0)), servers=2, reference_sequences=16)
    kinds, end = _verl_like_run(flat, partial)
    kinds_without, end_without = _verl_like_run(None, partial)
    # the same events in the same order, the same end (a refit notifies its calls in
    # registration order, so a seeded run is the same run every time)
    assert kinds == kinds_without
    assert end == end_without
    assert _verl_like_run(flat, partial) == (kinds, end)


@pytest.mark.parametrize("partial", [False, True])
def test_a_server_running_fewer_sequences_ends_the_run_sooner(partial):
    # reference: every generator busy (8 groups x 4 sequences on 2 servers); whenever
    # fewer run, the rest decode faster
    curve = DecodeCurve(points=((1, 1.0), (16, 2.0)), servers=2, reference_sequences=16)
    _, end = _verl_like_run(curve, partial)
    _, end_without = _verl_like_run(None, partial)
    assert end < end_without


def test_a_decode_model_with_episodes_or_of_the_wrong_type_is_refused():
    cfg = load_config(None, ["rollout.partial.enabled=true"])
    timings = SyntheticTimings(generation=Lognormal(20.0), train_per_sequence_s=0.0)
    curve = DecodeCurve(points=CURVE, servers=1, reference_sequences=1)
    with pytest.raises(ValueError, match="^sim.decode: covers single-turn rollouts"):
        SimSpec(config=cfg, timings=timings, run_id="x", decode=curve, episode_turns=2)
    with pytest.raises(ValueError, match="^sim.decode: a DecodeCurve or None, got tuple"):
        SimSpec(config=cfg, timings=timings, run_id="x", decode=CURVE)  # type: ignore[arg-type]
