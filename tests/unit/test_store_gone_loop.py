"""The store goes away for longer than the append budget in the middle of a run.

Seen in a Sentinel failover with one replica and ``store.replicas = 1``: the batch of
``WeightsPublished`` landed on the new primary but no replica could confirm it, the
journal gave up after its retries, and the train pump took that for a *worker* error:
it appended ``StepAborted(reason="worker error: StoreUnavailableError ...")`` at the
position before the batch that had landed, and the run ended on "log moved by fewer
entries than the batch (partial overlap)", exit status 2 -- a message that named
neither the store nor the way on. A store that is gone ends the run as such."""

from __future__ import annotations

import asyncio

import pytest

from controller.log_writer import Backoff
from controller.loop import Controller
from controller.recovery import reconcile_workers
from events import schema as ev
from events.errors import StoreUnavailableError
from events.memory_store import MemoryEventStore
from tests.unit.test_loop_inprocess import RUN, Harness, make_config


class GoesAway(MemoryEventStore):
    """Lands the batch that publishes ``weight_version`` 1, then answers every append,
    that one included, with StoreUnavailableError (its outcome in doubt)."""

    down = False

    def append(self, run_id, events, *, expected_position, epoch):  # type: ignore[override]
        if self.down:
            raise StoreUnavailableError("Redis at redis://db:6379/0 is unavailable: no replica")
        positions = super().append(run_id, events, expected_position=expected_position, epoch=epoch)
        if any(isinstance(e, ev.WeightsPublished) and e.weight_version == 1 for e in events):
            self.down = True
            raise StoreUnavailableError("Redis at redis://db:6379/0 is unavailable: no replica")
        return positions


@pytest.mark.parametrize("publish", ["in_line", "behind"])
def test_a_store_gone_past_the_budget_ends_the_run_as_a_store_error(tmp_path, publish: str) -> None:
    h = Harness(make_config("run.steps=4", f"controller.publish={publish}"), tmp_path)
    store = GoesAway()
    assert store.claim_epoch(RUN) == h.writer.epoch
    for stored in h.store.read(RUN):  # the run as created, in the store that will go away
        store.append(RUN, [stored.event], expected_position=stored.position - 1, epoch=h.writer.epoch)
    h.writer.store = store
    try:
        asyncio.run(reconcile_workers(h.writer, h.workers, h.cfg.checkpoint,
                                      checkpoint_dir=h.checkpoint_dir))
        w = h.workers
        controller = Controller(h.writer, h.cfg, w.trainer, w.generators, w.publisher,
                                w.payloads, checkpoint_dir=h.checkpoint_dir)
        controller.journal.backoff = Backoff(tries=2, first_delay_s=0.001)
        with pytest.raises(StoreUnavailableError, match="failed 2 times"):
            asyncio.run(controller.run())
    finally:
        h.workers.close()
    logged = [s.event for s in store.read(RUN)]
    assert not [e for e in logged if isinstance(e, ev.StepAborted)]
    assert isinstance(logged[-1], ev.WeightsPublished) and logged[-1].weight_version == 1
