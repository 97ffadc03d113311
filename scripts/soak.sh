#!/usr/bin/env bash
# Chaos soak: many random crash scenarios against real controller processes.
#
#   scripts/soak.sh [SCENARIOS] [FIRST_SEED]      (defaults: 200, a seed from the clock)
#
# Each scenario is one of: random SIGKILLs of the controller process; a chain of random
# crash points across restarts; an in-run trainer or generator death followed by a
# crash; every one is resumed to N steps and checked like the CI chaos suite (audit,
# accounting of every group, acknowledged steps, replay --retrain digest == final).
# Prints one line per scenario and a summary; exits 1 if any scenario failed.
# Artefacts of failed scenarios are kept under $SOAK_DIR (default: a temp directory).
set -euo pipefail
cd "$(dirname "$0")/.."
SCENARIOS="${1:-200}"
SEED="${2:-$(date +%s)}"
export SOAK_DIR="${SOAK_DIR:-$(mktemp -d -t rlc-soak-XXXX)}"
exec .venv/bin/python -m tests.chaos.soak "$SCENARIOS" "$SEED"
