"""Prometheus metrics of a running controller: ``/metrics`` over HTTP, off by default.

``[metrics] port = N`` (``--set metrics.port=9464``) serves, on ``metrics.host``
(loopback unless told otherwise), what the log writer appends as it is acknowledged:
the controller's ``LogWriter`` calls ``ControllerMetrics.on_append`` after folding each
batch (``LogWriter.listeners``), so the figures are the log's, never the loop's guesses,
and cost a few counter increments per event. A controller that never appends (a
read-only tool) exports nothing; the dashboard reads the log instead.

    rlc_events_appended_total{type}     events appended, by event type
    rlc_groups_{admitted,committed,evicted,failed}_total
    rlc_trainer_version, rlc_weight_version      gauges
    rlc_buffer_groups, rlc_in_flight_groups      committed unclaimed / admitted groups
    rlc_group_lag_versions               histogram: lag of each group a finished step consumed
    rlc_step_duration_seconds            histogram: StepBegun -> StepFinished
    rlc_refit_duration_seconds           histogram: StepFinished -> WeightsPublished (same version)
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from controller.core.state import RunState
from events import schema as ev

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class MetricsSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[metrics]``: the controller's Prometheus endpoint."""

    port: int = 0
    """Port of ``/metrics``; 0 = off (the default)."""
    host: str = "127.0.0.1"
    """Address to bind: loopback by default; a routable one exposes the run's figures
    (no secrets, but no authentication either) to that network."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics.port must be in 0..65535 (0 = off), got {self.port}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(f"metrics.host must be an IP address, got {self.host!r}") from None


class ControllerMetrics:
    """The figures, as plain numbers the loop thread bumps (a dict increment per event)
    and the scrape turns into metric families (``collect``, on the server's thread).
    Each instance has a registry of its own: two controllers in one process (tests)
    do not collide."""

    def __init__(self) -> None:
        # Imported here: loading a config (which names MetricsSection) stays light.
        from prometheus_client import CollectorRegistry

        #: events appended per type; every type is there from the start, so the dict
        #: never changes size while a scrape reads it
        self.appended: dict[type, int] = {cls: 0 for cls in ev.EVENT_TYPES.values()}
        self.state: RunState | None = None
        self.lag = _Buckets(LAG_BUCKETS)
        self.step_s = _Buckets(DURATION_BUCKETS)
        self.refit_s = _Buckets(DURATION_BUCKETS)
        #: trainer_version -> ts of its StepFinished (only the newest is waited for)
        self._finished_at: dict[int, float] = {}
        self._server: Any = None
        #: where ``serve`` serves (empty until then)
        self.url = ""
        self._timed = {ev.StepFinished: self._step_finished, ev.WeightsPublished: self._published}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def on_append(self, events: Sequence[ev.Event], state: RunState) -> None:
        """After the writer folded an acknowledged batch into ``state``: a dict increment
        per event, and a little more for the two types the histograms time."""
        self.state = state
        appended, timed = self.appended, self._timed
        for e in events:
            kind = type(e)
            appended[kind] += 1
            if kind in timed:
                timed[kind](e, state)

    def _published(self, e: ev.WeightsPublished, state: RunState) -> None:
        began = self._finished_at.pop(e.weight_version, None)
        if began is not None:
            self.refit_s.observe(max(0.0, e.ts - began))

    def _step_finished(self, e: ev.StepFinished, state: RunState) -> None:
        record = state.steps.get(e.step)
        if record is None:
            return
        self.step_s.observe(max(0.0, e.ts - record.begun_ts))
        groups = state.groups
        for group_id in record.group_ids:
            lag = groups[group_id].lag
            if lag is not None:
                self.lag.observe(lag)
        self._finished_at = {e.trainer_version: e.ts}

    def collect(self) -> Iterator[Any]:
        """The metric families, built at each scrape (``prometheus_client`` Collector)."""
        from prometheus_client.core import (
            CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)

        by_type = CounterMetricFamily("rlc_events_appended", "Events appended to the log, "
                                      "by type", labels=["type"])
        counts = {cls.__name__: n for cls, n in self.appended.items()}
        for name, n in counts.items():
            by_type.add_metric([name], n)
        yield by_type
        for what, kind in GROUP_COUNTERS:
            yield CounterMetricFamily(f"rlc_groups_{what}", f"{kind} appended",
                                      value=counts[kind])
        state = self.state
        if state is not None:
            for name, doc, value in (
                ("rlc_trainer_version", "The trainer's version per the log", state.trainer_version),
                ("rlc_weight_version", "Last version generators acknowledged", state.weight_version),
                ("rlc_buffer_groups", "Committed groups not yet claimed", len(state.buffer)),
                ("rlc_in_flight_groups", "Admitted groups not yet committed", len(state.admitted)),
            ):
                yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, buckets in (
            ("rlc_group_lag_versions", "Lag of each group a finished step consumed "
             "(trainer versions)", self.lag),
            ("rlc_step_duration_seconds", "StepBegun to StepFinished", self.step_s),
            ("rlc_refit_duration_seconds", "StepFinished to the WeightsPublished of its "
             "version", self.refit_s),
        ):
            yield HistogramMetricFamily(name, doc, buckets=buckets.cumulative(),
                                        sum_value=buckets.total)

    def serve(self, section: MetricsSection) -> str:
        """Serve ``/metrics`` on a daemon thread; returns its URL."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(section.port, addr=section.host,
                                            registry=self.registry)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}/metrics"
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


GROUP_COUNTERS = (("admitted", "RolloutAdmitted"), ("committed", "GroupCommitted"),
                  ("evicted", "GroupEvicted"), ("failed", "GroupFailed"))


class _Buckets:
    """A histogram's counts per upper bound (+Inf last) and its sum, as plain numbers."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        from prometheus_client.utils import floatToGoString  # "1.0", "+Inf": as Histogram writes

        out, running = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out
