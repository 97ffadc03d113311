#!/usr/bin/env bash
# Set up everything rl-controller needs on a fresh machine: redis-server (apt),
# a virtual environment in .venv, the pinned CPU torch first (so no CUDA build is
# pulled), then the project with its test extras. Safe to re-run.
#   --vllm   also install vLLM's CPU build (scripts/setup_vllm.sh), for rollout.backend = "vllm"
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "[setup] unknown option $arg (known: --vllm)" >&2; exit 2 ;;
  esac
done

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
# chromium + chromium-driver: the dashboard's browser tests drive a real headless
# Chromium (selenium, in the dev extra). Installed only when missing, and only as root;
# elsewhere the browser tests skip and say so.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium chromium-driver (apt; the browser tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "[setup] note: chromium / chromedriver not found; the browser tests will skip" >&2
  fi
fi
# The packaged service is not used: the CLI and the tests start their own servers.
if command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now redis-server redis-sentinel >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
# RLC_EXTRAS: the project's extras, by default dev, megatron and envs (the multi-turn
# environment packages; the Docker image sets "megatron", or "vllm" for CUDA);
# RLC_TORCH_INDEX: where torch comes from (the CPU image sets PyTorch's CPU index).
EXTRAS=${RLC_EXTRAS-dev,megatron,envs}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
echo "[setup] installing torch==2.13.0 and the project [${EXTRAS}]"
if [ -n "${RLC_TORCH_INDEX:-}" ]; then
  .venv/bin/pip install -q --index-url "$RLC_TORCH_INDEX" torch==2.13.0
else
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".${EXTRAS:+[$EXTRAS]}"

# docker-compose (v1, the one on PyPI) validates docker/compose.yaml in the tests. Its
# pins do not install on Python 3.11 (PyYAML < 6), so it lives in a venv of its own,
# installed without its pins plus the libraries it needs.
if [[ ",${EXTRAS}," == *",dev,"* ]] && [ ! -x .tools/bin/docker-compose ]; then
  echo "[setup] installing docker-compose into .tools (validates docker/compose.yaml)"
  "$PY" -m venv .tools
  .tools/bin/pip install -q --no-deps docker-compose==1.29.2
  .tools/bin/pip install -q --no-warn-conflicts "PyYAML>=6" docopt "jsonschema<4" texttable requests \
    "websocket-client<1" "docker>=5,<7" "python-dotenv<1" distro dockerpty
fi
if [ "$WITH_VLLM" = 1 ]; then bash scripts/setup_vllm.sh; fi
echo "[setup] done: .venv/bin/rl-controller --help"
