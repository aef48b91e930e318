#!/usr/bin/env bash
# Installs (idempotently) the PyPI wheels that carry NVRTC and ptxas, and prints the
# `export` lines that put them where cudarc (dynamic loading) and the kernel compile test
# find them. Usage in CI:   eval "$(.ci/cuda-env.sh)"
# Everything but the export lines goes to stderr. Fails (exit 1) if the wheels cannot be
# installed; the caller may then skip the kernel test, which also skips by itself when
# libnvrtc is missing.
#
# The versions are pinned, and match cudarc's `cuda-12040` feature: CUDA 12.4 Update 1.
# Kernels are loaded as cubins for the GPU's own architecture, which any 12.x driver
# accepts; PTX (the fallback) is accepted only by a driver at least as new as the NVRTC
# that wrote it, so an unpinned, newest NVRTC would make the fallback fail on the 535/550
# drivers common on consumer GPUs. Change both pins together.
set -euo pipefail
PY="${PYTHON:-python3}"
NVRTC_VERSION="12.4.127"
NVCC_VERSION="12.4.131"
installed() {
    "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'
}
if [ "$(installed nvidia-cuda-nvrtc-cu12)" != "$NVRTC_VERSION" ] \
    || [ "$(installed nvidia-cuda-nvcc-cu12)" != "$NVCC_VERSION" ]; then
    "$PY" -m pip install --quiet "nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION" \
        "nvidia-cuda-nvcc-cu12==$NVCC_VERSION" >&2
fi
NVRTC_LIB="$("$PY" -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib"))')"
NVCC_BIN="$("$PY" -c 'import nvidia.cuda_nvcc, os; print(os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin"))')"
if [ ! -e "$NVRTC_LIB/libnvrtc.so.12" ]; then
    echo "cuda-env: libnvrtc.so.12 not in $NVRTC_LIB" >&2
    exit 1
fi
echo "export LD_LIBRARY_PATH=\"$NVRTC_LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export TIDESTORE_NVRTC_PINNED=\"$NVRTC_VERSION\""
if [ -x "$NVCC_BIN/ptxas" ]; then
    echo "export PATH=\"$NVCC_BIN:\$PATH\""
else
    echo "cuda-env: ptxas not found in $NVCC_BIN (PTX will be compiled but not assembled)" >&2
fi
