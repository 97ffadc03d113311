"""The worker-side fence (workers/fencing.py): admission, guards, the typed error."""

from __future__ import annotations

import pickle
import threading

import pytest

from events.errors import FencedError
from workers.calls import TrainerCalls
from workers.fencing import EpochFence, EpochToken, Fenced, StaleEpochError
from workers.handles import _stamped


class Worker(Fenced):
    def __init__(self) -> None:
        self.fence = EpochFence("r1", "worker-x")
        self.writes: list[int] = []

    def write(self, value: int) -> int:
        with self.fence.guard():
            self.writes.append(value)
        return value


def test_highest_epoch_wins_and_older_ones_are_refused() -> None:
    w = Worker()
    assert w.fenced(1, "write", 10) == 10
    assert w.fenced(3, "write", 30) == 30  # a new controller's first call raises it
    assert w.fenced(3, "write", 31) == 31
    with pytest.raises(StaleEpochError) as info:
        w.fenced(2, "write", 20)
    err = info.value
    assert isinstance(err, FencedError)
    assert (err.epoch, err.current_epoch, err.worker, err.method) == (2, 3, "worker-x", "write")
    assert str(err) == (
        "run 'r1': worker-x refused write from controller epoch 2: it has seen epoch 3 "
        "(another controller has taken over this run)"
    )
    assert w.writes == [10, 30, 31] and w.fence.refused == 1


def test_the_error_survives_pickling_as_it_crosses_ray() -> None:
    err = pickle.loads(pickle.dumps(StaleEpochError("r1", "trainer", "reset", 1, 2)))
    assert isinstance(err, StaleEpochError)
    assert (err.run_id, err.worker, err.method, err.epoch, err.current_epoch) == (
        "r1", "trainer", "reset", 1, 2,
    )
    assert "epoch 1" in str(err) and "epoch 2" in str(err)


def test_a_write_after_a_newer_admission_is_refused_by_the_guard() -> None:
    w = Worker()
    admitted, newer_came = threading.Event(), threading.Event()
    outcome: list[BaseException | int] = []

    def slow() -> int:
        admitted.set()
        assert newer_came.wait(30)
        return w.write(1)  # the side effect lands after epoch 2 was admitted

    def zombie() -> None:
        try:
            outcome.append(w.fence.call(1, "slow", slow))
        except StaleEpochError as err:
            outcome.append(err)

    t = threading.Thread(target=zombie)
    t.start()
    assert admitted.wait(30)
    w.fenced(2, "write", 2)
    newer_came.set()
    t.join(30)
    assert isinstance(outcome[0], StaleEpochError) and w.writes == [2]


def test_calls_without_an_epoch_or_to_private_names() -> None:
    w = Worker()
    assert w.write(5) == 5  # not through fenced: unfenced, and guard() is a no-op
    with pytest.raises(AttributeError, match="not a worker call"):
        w.fenced(1, "_private")
    m = TrainerCalls.begin_train_step  # a declared call travels by its name
    assert _stamped(None, m, (1,)) == ("begin_train_step", (1,))
    assert _stamped(EpochToken(), m, (1,)) == ("begin_train_step", (1,))
    assert _stamped(EpochToken(4), m, (1,)) == ("fenced", (4, "begin_train_step", 1))


def test_a_guard_waiting_in_released_lets_another_write_then_holds_again() -> None:
    # a weight update waits for the generating thread's step boundary; that thread may
    # first write a flush under the fence, so the waiting update must let go of it
    w = Worker()
    fence = w.fence
    inside, wrote = threading.Event(), threading.Event()
    held_after: list[bool] = []

    def wait_for_the_write() -> None:
        with fence.guard():
            with fence.released():
                inside.set()
                assert wrote.wait(timeout=120), "the write never got the fence"
            held_after.append(fence._lock.locked())  # taken back before the guard ends

    def writer() -> None:
        w.fenced(1, "write", 7)
        wrote.set()

    waiter = threading.Thread(target=fence.call, args=(1, "wait", wait_for_the_write))
    waiter.start()
    assert inside.wait(timeout=120)  # the write comes while the guarded thread waits
    other = threading.Thread(target=writer)
    other.start()
    waiter.join()
    other.join()
    assert w.writes == [7] and held_after == [True]
    assert not fence._lock.locked()
    with fence.released():  # outside a guard: nothing to let go of
        assert not fence._lock.locked()
