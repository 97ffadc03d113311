"""One OpenMP thread count for vLLM's CPU kernels, whichever thread calls the engine.

vLLM's CPU attention sizes its work plan by ``omp_get_max_threads()`` when it builds
the attention metadata, and its kernel checks that count again when it runs
(``cpu_attn_impl.hpp``: ``metadata->thread_num == thread_num``). That count is an
OpenMP ICV *of the calling thread*: a thread that has never set it starts at the
process default (``OMP_NUM_THREADS`` when the OpenMP runtime loaded, else the core
count), and torch sets it to torch's own count on that thread's first parallel op
(``at::internal::lazy_init_num_threads``). So a thread that enters
``LLM.generate`` before any torch op -- a Ray actor's second concurrency thread, any
fresh ``threading.Thread`` -- builds the metadata at the process default, then the
forward's first op switches the thread to torch's count, and the kernel fails
("2 vs. 1" on a 2-core machine in a ``num_cpus=1`` actor). Which thread gets a call is
up to Ray's scheduling, which is why it failed in a loaded CI run and not alone.

:class:`EngineThreads` fixes one count ``n`` (the generator's CPU allocation) and

* sets ``OMP_NUM_THREADS=n`` while the engine is built, so a multi-process engine's
  child starts at ``n`` and vLLM leaves torch's count alone;
* keeps torch's own ``set_num_threads``, which vLLM's CPU worker replaces process-wide
  with a no-op, and puts it back after the build;
* :meth:`pin` -- called by every thread right before it drives the engine -- first
  lets torch's lazy per-thread initialisation happen (``torch.get_num_threads``), then
  sets the thread's count to ``n``. Nothing later in that thread changes it again, so
  metadata and kernel agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class EngineThreads:
    """The thread count of one vLLM engine (see the module docstring)."""

    def __init__(self, num_threads: int | None = None) -> None:
        n = torch.get_num_threads() if num_threads is None else num_threads
        if n < 1:
            raise ValueError(f"vLLM generator num_threads must be >= 1, got {n}")
        self.num_threads = n
        #: torch's own setter; vLLM replaces ``torch.set_num_threads``, not this
        self._set: Callable[[int], None] = torch._C.set_num_threads

    @contextmanager
    def building(self) -> Iterator[None]:
        """Around ``vllm.LLM(...)``: the count in the environment, torch's setter kept."""
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.num_threads)
        self.pin()
        try:
            yield
        finally:
            torch.set_num_threads = self._set  # vLLM's CPU worker stubbed it out
            if before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = before
            self.pin()

    def pin(self) -> None:
        """Make the calling thread's OpenMP count ``num_threads``, for good."""
        torch.get_num_threads()  # torch's once-per-thread init runs now, not mid-forward
        self._set(self.num_threads)
