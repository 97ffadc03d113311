"""A local worker's calls run with the worker's torch thread count, as a Ray actor's do.

OpenMP keeps the intra-op thread count per calling thread, and ATen sets a thread's
count once, lazily, at its first parallel op, to the process-wide count of that moment.
In a ``--local-workers`` run TransferQueue's client sets that count (to 2 here) from its
own loop thread around every put, so the trainer's pool thread computed with 2 threads
where its spec said 1, its float32 steps rounded differently from ``replay --retrain``'s,
and every weight digest mismatched. ``LocalHandle(torch_threads=...)`` pins each pool
thread, past that lazy first set.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from workers.calls import TrainerCalls
from workers.handles import LocalHandle


class _Threads:
    def version_and_digest(self) -> int:  # a declared call: a parallel op, then the count
        a = torch.ones(64, 64)
        (a @ a).sum()
        return torch.get_num_threads()


def _set_elsewhere(n: int) -> None:
    """Another thread changes the process-wide count, as TransferQueue's client does."""
    t = threading.Thread(target=torch.set_num_threads, args=(n,))
    t.start()
    t.join()


def test_a_pinned_handle_computes_with_its_own_thread_count_whatever_another_thread_set():
    before = torch.get_num_threads()

    async def main() -> tuple[int, int]:
        free, pinned = LocalHandle(_Threads()), LocalHandle(_Threads(), torch_threads=1)
        try:
            await free.call(TrainerCalls.version_and_digest)  # both pool threads exist
            await pinned.call(TrainerCalls.version_and_digest)
            _set_elsewhere(2)
            return (await free.call(TrainerCalls.version_and_digest),
                    await pinned.call(TrainerCalls.version_and_digest))
        finally:
            free.close()
            pinned.close()

    try:
        torch.set_num_threads(2)  # what the unpinned pool thread then takes at its start
        assert asyncio.run(main()) == (2, 1)
    finally:
        torch.set_num_threads(before)


class _ChangedFirst(_Threads):
    def version_and_digest(self) -> int:
        _set_elsewhere(2)  # after the pin, before this thread's first parallel op
        return super().version_and_digest()


def test_a_pinned_thread_keeps_its_count_when_another_thread_changes_it_before_its_first_op():
    before = torch.get_num_threads()

    async def main() -> int:
        pinned = LocalHandle(_ChangedFirst(), torch_threads=1)
        try:
            return await pinned.call(TrainerCalls.version_and_digest)
        finally:
            pinned.close()

    try:
        torch.set_num_threads(1)
        assert asyncio.run(main()) == 1
    finally:
        torch.set_num_threads(before)
