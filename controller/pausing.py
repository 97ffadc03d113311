"""One generator call and the calls that resume it, driven by callbacks between pauses.

With partial rollouts (and durable episodes) a call returns at every pause, the pause
is appended, and a new call lets its groups go on: ~12 times per 10-turn episode group.
A task awaiting each call would take two steps per pause (the call's return, then the
append's acknowledgement) and a future for the acknowledgement; here the call's
future carries a done-callback that hands a pause to the recorder
(``controller.partial.PartialRecorder``), and the recorder's append issues the next
call itself (:meth:`PausingCall.resume`), for every call that append acknowledged. The
admission task awaits only :attr:`PausingCall.result`: the outcomes of the call in which
every group finished, or the error that ended the sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from workers.api import FINISHED, GeneratorClient, GenerationOutcome, GenerationRequest


class PausingCall:
    """A generator call's sequence of pauses (see the module docstring)."""

    def __init__(
        self,
        gen: GeneratorClient,
        reqs: list[GenerationRequest],
        pending: Awaitable[list[GenerationOutcome]],
        on_pause: Callable[[PausingCall, list[GenerationOutcome]], None],
    ) -> None:
        self.gen = gen
        #: the requests of the call in flight (the groups that have not finished)
        self.reqs = reqs
        #: hands a pause to the recorder, which calls :meth:`resume` once it is appended
        self.on_pause = on_pause
        #: the outcomes of the last call (every group done), or why the sequence ended
        self.result: asyncio.Future[list[GenerationOutcome]] = asyncio.get_running_loop().create_future()
        #: the error in ``result`` is the worker's (its groups' attempts failed), not the
        #: controller's (a failed append: the run stops)
        self.worker_failed = False
        self.pending: asyncio.Future = asyncio.ensure_future(pending)
        self.result.add_done_callback(self._ended)
        self.pending.add_done_callback(self._returned)

    def _returned(self, pending: asyncio.Future) -> None:
        if self.result.done() or pending is not self.pending:
            return  # cancelled meanwhile
        try:
            outcomes = list(pending.result())
            if len(outcomes) != len(self.reqs):
                raise RuntimeError(f"{len(outcomes)} outcomes for {len(self.reqs)} groups")
        except asyncio.CancelledError:
            self.result.cancel()
            return
        except Exception as err:  # a worker failure is data, not a crash
            self.worker_failed = True
            self.result.set_exception(err)
            return
        try:  # no one awaits this callback: whatever raises here must end ``result``
            if all(out.status in FINISHED for out in outcomes):
                self.result.set_result(outcomes)
            else:
                self.on_pause(self, outcomes)
        except Exception as err:
            self.fail(err)

    def resume(self, reqs: list[GenerationRequest]) -> None:
        """The pause is in the log: let its groups go on with ``reqs``."""
        if self.result.done():
            return  # cancelled (fenced, or the run stopped) while its pause was appended
        self.reqs = reqs
        try:
            self.pending = asyncio.ensure_future(self.gen.generate(reqs))
        except Exception as err:
            self.fail(err)
            return
        self.pending.add_done_callback(self._returned)

    def refuse(self, err: BaseException) -> None:
        """The log refused what the call returned before it was written (a pause or
        commit that breaks a rule: ``controller.core.prefold``): its worker's failure,
        as if the call had raised -- its groups' attempts fail and may be retried."""
        if not self.result.done():
            self.worker_failed = True
            self.result.set_exception(err)

    def fail(self, err: BaseException) -> None:
        """The controller could not record a pause (or issue the next call)."""
        if not self.result.done():
            self.result.set_exception(err)

    def cancel(self) -> None:
        self.result.cancel()

    def _ended(self, result: asyncio.Future) -> None:
        if result.cancelled():
            self.pending.cancel()
