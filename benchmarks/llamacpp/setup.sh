#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp's Python binding) from its PyPI sdist into a venv of its own,
# beside the project (ignored by git): bench_latency.py compares pagedkv with it on the same
# GGUF. A separate venv because it is a benchmark baseline, not a pagedkv dependency.
# CPU build with the SIMD extensions this CPU has (AVX2, and AVX-512 VNNI/VBMI/BF16 where present)
# and no BLAS: llama.cpp's own kernels. Not
# GGML_NATIVE: on a Sapphire Rapids VM -march=native turns on ggml's AMX path, which crashed
# (SIGSEGV in llama_decode) on these machines; the explicit flags run on Intel and AMD Zen 4 alike.
# --no-cache-dir: pip would otherwise reuse a wheel built earlier with other CMAKE_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${LLAMACPP_VENV:-$ROOT/.bench/llamacpp-venv}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# Its runtime deps (none pulls torch); the build needs cmake + scikit-build-core from PyPI.
"$VENV/bin/pip" install -q numpy typing-extensions diskcache jinja2
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# The AVX-512 kernels only where this CPU has them (an AVX2-only EPYC, Zen 2/3, would die of
# SIGILL in a build that enables them): each ggml flag follows its /proc/cpuinfo flag.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$CPU_FLAGS" == *" $1 "* ]] && echo ON || echo OFF; }
FLAGS="$FLAGS -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
FLAGS="$FLAGS -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni)"
FLAGS="$FLAGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="${CMAKE_ARGS:-$FLAGS -DGGML_BLAS=OFF -DLLAMA_CURL=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  "$VENV/bin/pip" install --no-deps --no-cache-dir --verbose "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'built in $VENV')"
