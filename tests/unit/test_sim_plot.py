"""The timing what-if's figure keeps legends off the data, whatever the scenario names."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from events.memory_store import MemoryEventStore  # noqa: E402
from replay.plots import timing_figure  # noqa: E402
from sim.whatif import run_whatif  # noqa: E402
from tests.unit.test_sim_whatif import hand_log  # noqa: E402

LONG = [
    {"staleness.window_versions": "1", "rollout.num_generators": "16"},
    {"staleness.window_versions": "2", "controller.publish": "behind",
     "rollout.groups_per_call": "2"},
    {"staleness.window_versions": "0"},
]


def test_legends_sit_outside_every_panel_and_long_names_do_not_squeeze_the_bars():
    import matplotlib.pyplot as plt

    store = MemoryEventStore()
    hand_log(store)
    fig = timing_figure(run_whatif(store, "hand", LONG))
    try:
        fig.canvas.draw()
        progress, _lag, bars = fig.axes
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert len(legends) == 2
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:  # neither over a panel's data nor over its x label
                assert not box.overlaps(ax.get_window_extent()), (legend, ax.get_title())
                assert not box.overlaps(ax.xaxis.label.get_window_extent()), ax.get_title()
        # every scenario's full name is in the legend, the bars carry short labels
        texts = " ".join(t.get_text() for t in progress.get_legend().get_texts())
        assert "controller.publish=behind" in texts.replace("\n", " ")
        assert [t.get_text() for t in bars.get_yticklabels()] == ["recorded", "S1", "S2", "S3", "S4"]
        assert bars.get_window_extent().width >= 0.8 * progress.get_window_extent().width
    finally:
        plt.close(fig)
