#!/usr/bin/env bash
# Set up everything rl-controller needs on a fresh machine: redis-server (apt),
# a virtual environment in .venv, the pinned CPU torch first (so no CUDA build is
# pulled), then the project with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-sentinel: the failover tests run three sentinels; deployments use it too.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-sentinel >/dev/null 2>&1 || missing+=(redis-sentinel)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${missing[*]} (apt)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] ${missing[*]} not found; install (e.g. 'apt-get install ${missing[*]}')" >&2
    exit 1
  fi
fi
# The packaged service is not used: the CLI and the tests start their own servers.
if command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now redis-server redis-sentinel >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
echo "[setup] installing torch==2.13.0 (CPU) and the project"
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev,megatron]'
echo "[setup] done: .venv/bin/rl-controller --help"
