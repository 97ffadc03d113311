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
