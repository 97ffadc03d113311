"""bench/verl_ablation.py: verl's budget as they compute it, and a bad argument refused
in one line (not a traceback, not a silent calibration)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "verl_ablation.py"
_spec = importlib.util.spec_from_file_location("verl_ablation", _PATH)
assert _spec and _spec.loader
verl_ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verl_ablation)


def test_the_budget_is_verls_max_required_samples():
    """int(128 x (1 + threshold) x 4), truncated as verl's int() does: the capacities
    docs/scale.md's table lists."""
    assert [verl_ablation.budget(t) for t in (0.0, 0.1, 0.3, 0.5)] == [512, 563, 665, 768]


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "argument --steps: must be > 0 (got 0)"),
    (["--median-s", "0", "--steps", "1"], "argument --median-s: must be > 0 (got 0)"),
    (["--cap-s", "-5"], "argument --cap-s: must be > 0 (got -5)"),
    (["--selection", "newest"], "argument --selection: invalid choice: 'newest'"),
    (["--decode", "h20"], "argument --decode: invalid choice: 'h20'"),
    (["--calibrate-cap", "--median-s", "60"], "--calibrate-cap finds both the cap and the median"),
    (["--calibrate-cap", "--cap-s", "300"], "--calibrate-cap finds both the cap and the median"),
])
def test_a_bad_argument_is_one_error_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        verl_ablation.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.split(": error: ", 1)[1].startswith(says), last
    assert "Traceback" not in err


def test_the_decode_model_is_verls_servers_with_a_full_server_as_reference():
    """16 rollout servers (64 GPUs at tensor-parallel 4); a drawn time holds while each
    runs 16 groups of 16 sequences; --decode none is today's per-slot model."""
    import argparse

    args = argparse.Namespace(decode="nim-llama31-8b-h100", concurrent=verl_ablation.CONCURRENT)
    curve = verl_ablation.decode_curve(args)
    assert (curve.servers, curve.reference_sequences) == (16, 256)
    assert curve.points == verl_ablation.NIM_LLAMA31_8B_H100
    assert verl_ablation.decode_curve(argparse.Namespace(decode="none", concurrent=256)) is None
    # every curve has the cap its own calibration found (none is left to a KeyError)
    assert set(verl_ablation.DEFAULT_CAP_S) == set(verl_ablation.DECODE_CURVES)
