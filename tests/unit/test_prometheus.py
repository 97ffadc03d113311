"""``controller.prometheus``: the controller's /metrics, fed by the log writer's appends.

The figures are checked exactly against the log they were fed (counts per type, group
counters, gauges, the lag and step-duration histograms' counts and sums), read back
the way Prometheus reads them: over HTTP from the served endpoint, parsed with
``prometheus_client``'s own text parser.
"""

from __future__ import annotations

import urllib.request
from collections import Counter

import pytest

from controller.config import ConfigError, load_config
from controller.core.reducer import apply
from controller.core.state import initial_state
from controller.prometheus import ControllerMetrics, MetricsSection
from controller.startup import create_run
from events import schema as ev
from events.memory_store import MemoryEventStore
from tests.unit.random_log import random_run


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """name -> {labels: value} for every sample at ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_the_figures_are_the_logs() -> None:
    b = random_run(4, 30, p_fail=0.05, p_abort=0.05, p_restart=0.0)
    metrics = ControllerMetrics()
    state = initial_state()
    for stored in b.events:
        apply(state, stored)
        metrics.on_append([stored.event], state)
    url = metrics.serve(MetricsSection(port=0))
    try:
        assert url.startswith("http://127.0.0.1:")
        got = scrape(url)
    finally:
        metrics.close()
    types = Counter(type(s.event).__name__ for s in b.events)
    appended = got["rlc_events_appended_total"]
    assert {dict(k)["type"]: v for k, v in appended.items() if v} == dict(types)
    assert got["rlc_groups_admitted_total"][()] == types["RolloutAdmitted"]
    assert got["rlc_groups_committed_total"][()] == types["GroupCommitted"]
    assert got["rlc_groups_evicted_total"][()] == types["GroupEvicted"]
    assert got["rlc_groups_failed_total"][()] == types["GroupFailed"]
    assert got["rlc_trainer_version"][()] == state.trainer_version == 30
    assert got["rlc_buffer_groups"][()] == len(state.buffer)
    assert got["rlc_in_flight_groups"][()] == len(state.admitted)
    finished = state.finished_steps()
    lags = [state.groups[g].lag for s in finished for g in s.group_ids]
    assert got["rlc_group_lag_versions_count"][()] == len(lags)
    assert got["rlc_group_lag_versions_sum"][()] == sum(lags)
    buckets = {dict(k)["le"]: v for k, v in got["rlc_group_lag_versions_bucket"].items()}
    assert buckets["0.0"] == lags.count(0) and buckets["1.0"] == sum(1 for x in lags if x <= 1)
    assert buckets["+Inf"] == len(lags)
    expected_s = 0.0
    for s in finished:  # the histogram adds them in this order
        expected_s += s.ended_ts - s.begun_ts
    assert got["rlc_step_duration_seconds_count"][()] == len(finished)
    assert got["rlc_step_duration_seconds_sum"][()] == expected_s


def test_the_log_writer_feeds_its_listeners_what_the_store_acknowledged() -> None:
    store = MemoryEventStore()
    writer = create_run(store, "r-metrics", config={}, seed=0, code_version="t",
                        window_versions=1, groups_per_step=2, samples_per_group=2)
    metrics = ControllerMetrics()
    writer.listeners.append(metrics.on_append)
    writer.append(*(writer.make(ev.RolloutAdmitted, event_id=f"group:g{i}:admitted:a1",
                                group_id=f"g{i}", attempt=1, prompt_index=i, prompt_ref="p",
                                weight_version=0, n_samples=2, sample_seed=i,
                                generator="generator-0") for i in range(3)))
    assert metrics.appended[ev.RolloutAdmitted] == 3
    assert metrics.state is writer.state and len(writer.state.admitted) == 3


def test_metrics_are_off_by_default_and_the_port_is_checked() -> None:
    assert load_config().metrics == MetricsSection(port=0, host="127.0.0.1")
    with pytest.raises(ConfigError, match="metrics.port must be in 0..65535"):
        load_config(overrides=["metrics.port=70000"])
    with pytest.raises(ConfigError, match="metrics.host must be an IP address"):
        load_config(overrides=['metrics.host="example.org"'])
