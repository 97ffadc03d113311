"""``rl-controller simulate`` end to end: a log in a real redis-server, JSON out."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from events.redis_store import RedisEventStore
from tests.unit.test_sim_whatif import STEPS, hand_log

pytestmark = pytest.mark.integration


def test_simulate_reproduces_the_hand_log_and_predicts_a_wider_window(redis_url, tmp_path, capsys):
    store = RedisEventStore(redis_url)
    try:
        hand_log(store, "hand")
    finally:
        store.close()
    plot = tmp_path / "sim.png"
    code = main(["simulate", "--redis-url", redis_url, "--run", "hand",
                 "--what-if", "window=1", "--json", "--plot", str(plot)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["reproduction"]["commit_order_identical"] and out["reproduction"]["batches_identical"]
    assert out["recorded"]["wall_s"] == pytest.approx(19 * STEPS)
    baseline, wider = out["scenarios"]
    assert baseline["wall_s"] == pytest.approx(19 * STEPS)
    assert wider["changes"] == {"staleness.window_versions": "1"}
    assert wider["wall_s"] == pytest.approx(11 * STEPS + 8) and wider["lag_max"] == 1
    assert plot.stat().st_size > 10_000


def test_a_bad_scenario_is_named(redis_url, capsys):
    store = RedisEventStore(redis_url)
    try:
        hand_log(store, "hand")
    finally:
        store.close()
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--redis-url", redis_url, "--run", "hand", "--what-if", "window=-1"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "staleness.window_versions" in captured.err + captured.out
