"""A generator call's pauses, driven by callbacks: every way the sequence ends reaches
``PausingCall.result``, the one thing the admission task awaits."""

from __future__ import annotations

import asyncio

import pytest

from controller.pausing import PausingCall


def _never_paused(call: PausingCall, outs: list) -> None:
    raise AssertionError("no pause expected")


async def _await(fut: asyncio.Future) -> object:
    return await fut


def test_an_outcome_the_callback_cannot_read_ends_the_call_as_the_controllers_error():
    # a callback's exception would go to the loop's handler and the awaiting task would
    # wait forever; before pauses went by callback this stopped the run
    async def main() -> PausingCall:
        returned = asyncio.get_running_loop().create_future()
        returned.set_result([object()])  # one outcome for one group, but not an outcome
        call = PausingCall(None, ["g0"], returned, _never_paused)  # type: ignore[arg-type]
        with pytest.raises(AttributeError):
            await asyncio.wait_for(call.result, timeout=1.0)
        return call

    assert asyncio.run(main()).worker_failed is False


def test_a_worker_error_ends_the_call_as_the_workers():
    async def main() -> PausingCall:
        returned = asyncio.get_running_loop().create_future()
        returned.set_exception(RuntimeError("reward() raised"))
        call = PausingCall(None, ["g0"], returned, _never_paused)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="reward"):
            await call.result
        return call

    assert asyncio.run(main()).worker_failed is True


def test_cancelling_the_awaiting_task_cancels_the_call_in_flight():
    async def main() -> bool:
        in_flight = asyncio.get_running_loop().create_future()
        call = PausingCall(None, ["g0"], in_flight, _never_paused)  # type: ignore[arg-type]
        task = asyncio.create_task(_await(call.result))  # as the admission's task does
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the result's done-callbacks run a turn later
        return in_flight.cancelled()

    assert asyncio.run(main())
