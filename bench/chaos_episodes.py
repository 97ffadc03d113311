"""The episode chaos proof at full size: 50+ random kills of durable episodes.

CI runs ``tests/chaos/test_episode_crashes.py`` with a few kills (each costs a process
start); this runs its random test with ``--kills`` (default 50) and prints what it
counted: processes and generators killed, tool calls made (each a line in the tool's
own ledger), calls re-issued with their key after a kill, model turns sampled and
recorded turns served to a resumed attempt, episodes restarted -- with the test's
checks (0 side effects twice, 0 recorded turns sampled again, audit clean, every group
consumed once, the weights retrained from the log equal) passing or failing it.

    python bench/chaos_episodes.py                # 50 kills, seed 31 (minutes)
    python bench/chaos_episodes.py --kills 80 --seed 7
    python bench/chaos_episodes.py --agent        # the same with agent code playing them
                                                  # (tests/chaos/test_agent_crashes.py)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/chaos/test_episode_crashes.py::test_random_kills_repeat_no_side_effect_and_regenerate_no_turn"
AGENT_TEST = "tests/chaos/test_agent_crashes.py::test_random_kills_repeat_no_tool_effect_and_regenerate_no_completion"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--agent", action="store_true",
                   help="episodes played by OpenAI-client agent code (tests.plugin_tasks:LedgerAgent)")
    args = p.parse_args(argv)
    if args.kills < 1:
        p.error(f"--kills must be >= 1, got {args.kills}")
    prefix = "RLC_AGENT" if args.agent else "RLC_EPISODE"
    env = {**os.environ, f"{prefix}_KILLS": str(args.kills), f"{prefix}_SEED": str(args.seed)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           AGENT_TEST if args.agent else TEST]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    counted = [line for line in done.stdout.splitlines() if line.startswith("kills: ")]
    print("\n".join(counted) or done.stdout[-3000:])
    print(f"seed {args.seed}, at least {args.kills} kills: "
          + ("every check passed" if done.returncode == 0 else "FAILED (pytest output above)"))
    if done.returncode != 0 and counted:
        print(done.stdout[-3000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
