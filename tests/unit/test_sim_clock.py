"""The virtual-time event loop: sleeps and timeouts jump, callbacks may be charged."""

from __future__ import annotations

import asyncio
import time

import pytest

from sim.clock import VirtualTimeError, VirtualTimeLoop


def _run(loop: VirtualTimeLoop, coro):
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        return runner.run(coro)


def test_a_day_of_sleeps_takes_no_real_time():
    loop = VirtualTimeLoop(start_s=100.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append((name, asyncio.get_running_loop().time()))

    async def main() -> None:
        await asyncio.gather(sleeper("day", 86_400), sleeper("hour", 3_600), sleeper("now", 0))

    start = time.perf_counter()
    _run(loop, main())
    assert time.perf_counter() - start < 5.0
    assert woke == [("now", 100.0), ("hour", 3_700.0), ("day", 86_500.0)]
    assert loop.idle_s == pytest.approx(86_400.0)


def test_timeouts_fire_in_virtual_time():
    loop = VirtualTimeLoop()

    async def main() -> float:
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await never
        return asyncio.get_running_loop().time()

    assert _run(loop, main()) == 0.5


def test_charged_time_counts_callbacks_but_not_uncharged_sections():
    loop = VirtualTimeLoop(charge_real_time=True)

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    async def main() -> tuple[float, float]:
        t0 = loop.time()
        spin(0.05)
        charged = loop.time() - t0
        t1 = loop.time()
        with loop.uncharged():
            spin(0.05)
        return charged, loop.time() - t1

    charged, uncharged = _run(loop, main())
    assert charged >= 0.05
    assert uncharged < 0.02


def test_a_deadlock_is_an_error_not_a_hang():
    loop = VirtualTimeLoop()

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    with pytest.raises(VirtualTimeError, match="idle with no timer"):
        _run(loop, main())


def test_threads_are_refused():
    loop = VirtualTimeLoop()

    async def main() -> None:
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0)

    with pytest.raises(VirtualTimeError, match="run_in_executor"):
        _run(loop, main())


def test_worker_timers_fire_in_virtual_time_in_order_behind_one_loop_timer():
    loop = VirtualTimeLoop()
    fired: list[tuple[str, float]] = []

    def note(name: str) -> None:
        fired.append((name, loop.time()))

    async def main() -> int:
        for name, delay in (("c", 3.0), ("a", 1.0), ("b", 1.0), ("d", 0.0)):
            loop.call_uncharged_later(delay, note, name)
        held = sum(not h.cancelled() for h in loop._scheduled)  # the fleet's: one
        await asyncio.sleep(2.0)
        fired.append(("controller", loop.time()))
        await asyncio.sleep(2.0)
        return held

    assert _run(loop, main()) == 1
    assert fired == [("d", 0.0), ("a", 1.0), ("b", 1.0), ("controller", 2.0), ("c", 3.0)]


def test_nested_uncharged_sections_count_once():
    loop = VirtualTimeLoop()
    cpu0 = time.thread_time()
    with loop.uncharged():
        with loop.uncharged():
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
    # counted twice, the sections' CPU would exceed the thread's over all of them
    assert 0.05 <= loop.uncharged_cpu_s <= time.thread_time() - cpu0
    loop.close()


def test_a_worker_timer_that_raises_leaves_the_others_armed():
    # as with one loop timer each: the error goes to the loop's handler, the fleet goes on
    loop = VirtualTimeLoop()
    errors: list[object] = []
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    fired: list[tuple[str, float]] = []

    def boom() -> None:
        raise ValueError("a simulated worker's bug")

    async def main() -> None:
        loop.call_uncharged_later(1.0, boom)
        loop.call_uncharged_later(1.0, lambda: fired.append(("same time", loop.time())))
        loop.call_uncharged_later(2.0, lambda: fired.append(("later", loop.time())))
        await asyncio.sleep(3.0)

    _run(loop, main())
    assert [type(e) for e in errors] == [ValueError]
    assert fired == [("same time", 1.0), ("later", 2.0)]


class _Ticks:
    """A clock that reads 1, 2, 3, ...: what a section subtracts becomes a count of reads."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)


def test_a_section_reads_the_clocks_only_at_its_outermost_edges(monkeypatch):
    # The section subtracts the CPU between its first read (last thing on entry) and its
    # second (first thing on exit): a nested section, or an error, reads nothing more.
    import sim.clock as clock

    cpu, real = _Ticks(), _Ticks()
    monkeypatch.setattr(clock, "_thread_time", cpu)
    monkeypatch.setattr(clock, "_perf_counter", real)
    loop = VirtualTimeLoop(charge_real_time=True)
    mark = loop._mark
    with loop.uncharged():
        for _ in range(3):
            with loop.uncharged():
                cpu()  # the body's own reads (a worker's work) fall inside the window
    assert (cpu.reads, loop.uncharged_cpu_s) == (5, 4.0)  # read 1 on entry, 5 on exit
    assert (real.reads, loop.uncharged_s) == (2, 1.0)
    assert loop._mark == mark + 1.0 and loop._uncharged_depth == 0
    with pytest.raises(ValueError, match="a worker's bug"):
        with loop.uncharged():
            raise ValueError("a worker's bug")
    assert (cpu.reads, loop.uncharged_cpu_s) == (7, 5.0)  # subtracted all the same
    assert loop._uncharged_depth == 0
    loop.close()


def test_deleting_an_episodes_scratch_rows_is_not_a_checkpoint_release():
    # A committed episode group's rows are its model turns ("seg:") and observations
    # ("obs:"): scratch, deleted at once. A release of payload rows takes the recorded
    # release time; mistaking scratch for one charged it to the trainer's checkpoints.
    from sim.timings import Lognormal, SyntheticTimings
    from sim.workers import Fleet, SimPayloads, SimTrainer

    loop = VirtualTimeLoop()
    fleet = Fleet(loop=loop, timings=SyntheticTimings(generation=Lognormal(1.0), train_per_sequence_s=0.0,
                                                      release=2.0))
    trainer = SimTrainer(fleet)
    payloads = SimPayloads(fleet, trainer)

    async def main() -> list[tuple[float, float]]:
        seen = []
        for keys in (["seg:g1/a1/s0/t1", "obs:g1/a1/s0/t1", "seg:g1/a1/s0/t2"], ["g1/1/0", "g1/1/1"]):
            await payloads.delete(keys)
            seen.append((loop.time(), trainer.checkpoint_s))
        return seen

    assert _run(loop, main()) == [(0.0, 0.0), (2.0, 2.0)]


def _suspends(body: list) -> list[int]:
    """Lines in ``body`` where a coroutine could give the loop away (nested defs aside)."""
    import ast

    found, stack = [], list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith, ast.Yield, ast.YieldFrom)):
            found.append(node.lineno)
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_no_uncharged_section_is_held_across_a_suspension():
    # The section is one object per loop with one depth count: a section held across an
    # await would leave the loop uncharged while the controller's tasks run, and a
    # section another task enters meanwhile would nest in it. Every section the
    # simulator enters must open and close within one callback.
    import ast
    from pathlib import Path

    import sim

    sections = 0
    for path in sorted(Path(sim.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.With, ast.AsyncWith)):
                continue
            if not any(isinstance(item.context_expr, ast.Call)
                       and isinstance(item.context_expr.func, ast.Attribute)
                       and item.context_expr.func.attr == "uncharged" for item in node.items):
                continue
            sections += 1
            assert not isinstance(node, ast.AsyncWith), f"{path.name}:{node.lineno}"
            assert _suspends(node.body) == [], f"{path.name}:{node.lineno}: await inside"
    assert sections >= 8  # the generators', the fleet's timers', the data plane's
