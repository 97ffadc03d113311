"""``rl-controller replay --episode`` through the CLI, against a real redis-server and a
real spill directory: it prints what the whole-run reload printed, token ids included,
reading only the episode's group from the spill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli.main import main
from events.redis_store import RedisEventStore
from replay.episode import episode_view, fill_ids, render_episode
from tests.unit.test_episode_views import _events, _log
from workers.dataplane import MemoryDataPlane, SpillDataPlane

RUN = "r1"


def _logged(redis_url: str):
    """The ``_log`` run (a two-turn group ``g1``) appended to the real server."""
    b, store = _log(), RedisEventStore(redis_url)
    try:
        store.append(RUN, _events(b), expected_position=0, epoch=store.claim_epoch(RUN))
    finally:
        store.close()
    return b


def _spill(data_dir: Path) -> Path:
    """Sample 0's committed row and sample 1's segment row of ``g1`` (the ``_log`` group),
    among the rows of 20 other groups."""
    spill = data_dir / "runs" / RUN / "spill"
    plane = SpillDataPlane(MemoryDataPlane(), spill)
    for g in range(2, 22):
        plane.put(RUN, [f"g{g}/a1/0", f"g{g}/a1/1"],
                  {"input_ids": [torch.arange(g, 3 * g), torch.arange(g)],
                   "prompt_len": [torch.tensor(1), torch.tensor(1)]})
    ids = [7, 8] + list(range(100, 109))  # a 2-token prompt, then 9 completion tokens
    plane.put(RUN, ["g1/a1/0"], {"input_ids": [torch.tensor(ids)], "prompt_len": [torch.tensor(2)]})
    plane.put(RUN, ["g1/a1/s1/k0"], {"tokens": [torch.arange(200, 205)],
                                     "logprobs": [torch.zeros(5)]})
    return spill


@pytest.mark.parametrize("sample, ids", [(0, "[103, 104, 105, 106]"), (1, "[200, 201, 202, 203, 204]")])
def test_replay_episode_prints_what_the_whole_reload_printed(redis_url, tmp_path, capsys, sample, ids):
    b = _logged(redis_url)
    spill = _spill(tmp_path)
    # the output before the keyed read: every spilled row of the run reloaded into a plane
    whole = SpillDataPlane(MemoryDataPlane(), spill)
    whole.reload(RUN, tidy=False)
    view = episode_view(RUN, _events(b), "g1", sample)
    fill_ids(view, whole, f"g1/a1/{sample}")
    rc = main(["replay", "--run", RUN, "--episode", f"g1/{sample}", "--redis-url", redis_url,
               "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out == "\n".join(render_episode(view)) + "\n"
    assert ids in out


def test_a_spill_of_an_earlier_release_is_one_line_not_a_traceback(redis_url, tmp_path, capsys):
    _logged(redis_url)
    old = tmp_path / "runs" / RUN / "spill" / RUN
    old.mkdir(parents=True)
    (old / "g1%2Fa1%2F0.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--run", RUN, "--episode", "g1/0", "--redis-url", redis_url,
              "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "safetensors format of an earlier release" in err
