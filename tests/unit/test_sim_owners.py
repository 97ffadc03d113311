"""Loop callbacks timed by owner: every callback counted once, under its own name."""

from __future__ import annotations

import asyncio
import asyncio.events

from sim.clock import VirtualTimeLoop
from sim.owners import callbacks_by_owner, is_simulator


def _noop() -> None:
    pass


async def _worker() -> None:
    await asyncio.sleep(1.0)
    await asyncio.sleep(1.0)


def test_tasks_and_callbacks_are_counted_by_owner_and_the_loop_is_restored():
    loop = VirtualTimeLoop()
    run = asyncio.events.Handle._run

    async def main() -> None:
        loop.call_soon(_noop)
        loop.call_uncharged_later(0.5, _noop)
        await loop.create_task(_worker())

    with callbacks_by_owner() as owners:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            runner.run(main())
    assert asyncio.events.Handle._run is run
    here = __name__
    # the worker task: its first step and one per sleep (the third ends it)
    assert owners.calls[f"{here}:task _worker"] == 3
    assert owners.calls[f"{here}:_noop"] == 1
    assert owners.calls["sim.clock:VirtualTimeLoop._run_workers"] == 1
    assert [n for n in owners.calls if is_simulator(n)] == ["sim.clock:VirtualTimeLoop._run_workers"]
    assert all(s >= 0.0 for s in owners.cpu_s.values())


def test_what_an_owner_runs_in_an_uncharged_section_is_not_its_charged_cpu():
    # a controller callback that calls a simulated worker: the worker's part is inside
    # the callback's CPU, and outside what the controller's figure charges to it
    import time

    loop = VirtualTimeLoop()

    def controller_calls_a_worker() -> None:
        with loop.uncharged():
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass

    async def main() -> None:
        loop.call_soon(controller_calls_a_worker)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    with callbacks_by_owner() as owners:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            runner.run(main())
    name = f"{__name__}:test_what_an_owner_runs_in_an_uncharged_section_is_not_its_charged_cpu.<locals>.controller_calls_a_worker"
    assert owners.calls[name] == 1
    assert owners.cpu_s[name] >= 0.02  # the worker's spin, inside the callback
    # exactly the section's CPU taken off: what is left is the callback's own
    assert owners.charged_s[name] == owners.cpu_s[name] - loop.uncharged_cpu_s
    assert owners.charged_s[name] < owners.cpu_s[name] - 0.019
