#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit, contract, integration
# (real redis-server, Ray, TransferQueue), e2e and chaos. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
