#!/usr/bin/env bash
# Installs (idempotently) a CUDA 13.0 toolkit from PyPI wheels into target/cuda13, and
# prints the `export` lines with which `cargo build --features gpu` (tidestore's CUDA code
# and candle's CUDA backend) builds without a CUDA installation or a GPU:
#
#     eval "$(.ci/gpu-build-env.sh)" && cargo build --release -p tidestore-app --features gpu
#
# Everything but the export lines goes to stderr; exit 1 if something cannot be set up.
# Needs python3 with pip, a C/C++ compiler (nvcc's host compiler) and cargo.
#
# Why each piece:
# - candle-kernels (candle-core's `cuda`) runs `nvcc` at build time (through cudaforge,
#   which finds it on PATH or as $CUDA_HOME/bin/nvcc and takes its headers from the
#   include/ beside it): nvidia-cuda-nvcc (nvcc, ptxas, fatbinary, nvlink), nvidia-nvvm
#   (cicc, libdevice), nvidia-cuda-crt (crt/host_config.h), nvidia-cuda-runtime
#   (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, libcudart) and nvidia-cuda-cccl (cuda/std,
#   cub). All CUDA 13 wheels unpack into one tree, nvidia/cu13/{bin,include,lib,nvvm}, which
#   is laid out like a toolkit, so it is $CUDA_HOME.
# - candle-core turns on cudarc's `dynamic-linking`: cudarc's build script then links
#   -lcuda -lnvrtc -lcublas -lcublasLt -lcurand, searching $CUDA_HOME/lib and
#   $CUDA_HOME/lib/stubs; candle-kernels adds -lcudart. The wheels (nvidia-cublas,
#   nvidia-curand, nvidia-cuda-nvrtc, nvidia-cuda-runtime) carry only the versioned files
#   (libcublas.so.13 ...), so lib/ gets the unversioned names the linker looks for as
#   links. libcuda comes with the driver, and no wheel carries the toolkit's link stub, so
#   lib/stubs/libcuda.so is made here: every function cudarc binds (read from cudarc's
#   own bindings), each returning CUDA_ERROR_STUB_LIBRARY (34), soname libcuda.so.1. It is
#   for linking: at run time the driver's libcuda.so.1 must be found instead (never put
#   lib/stubs on LD_LIBRARY_PATH on a machine with a driver; on one without, that lets
#   the binary start, and every CUDA call fails as on a machine without a GPU).
# - CUDA 13.0 and not newer: candle's kernels are PTX, compiled by the driver at load
#   time, and a driver accepts PTX only from a toolkit no newer than itself; 13.0 is the
#   toolkit of driver 580 (the oldest CUDA 13 driver), so the binary's PTX loads on 580
#   and newer. CUDA 13 itself needs driver >= 580 and a GPU of compute capability >= 7.5.
#   Linking against CUDA 13 libraries makes the binary need libcublas.so.13,
#   libcublasLt.so.13, libnvrtc.so.13, libcudart.so.13 and libcurand.so.10: those PyTorch's
#   cu13 wheels also carry. Change the pins together.
# - CUDA_COMPUTE_CAP: no GPU here for cudaforge to ask nvidia-smi about. 90 (H100/H200)
#   unless set; candle's PTX is then `compute_90a` and its MoE library `sm_90a`, so the
#   binary is for Hopper GPUs. Set CUDA_COMPUTE_CAP=80 for Ampere/Ada (then not Hopper).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
WHEELS=(
    "nvidia-cuda-nvcc==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
    "nvidia-cuda-nvrtc==13.0.88"
    "nvidia-cublas==13.0.2.14"
    "nvidia-curand==10.4.0.35"
)
TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
PREFIX="$TARGET_DIR/cuda13"
ROOT="$PREFIX/nvidia/cu13"
STAMP="$PREFIX/.installed"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${WHEELS[*]}" ]; then
    echo "gpu-build-env: installing ${WHEELS[*]} into $PREFIX" >&2
    rm -rf "$PREFIX"
    # One pip call: --target merges the wheels' shared nvidia/cu13 tree only within a call.
    "$PY" -m pip install --quiet --no-deps --target "$PREFIX" "${WHEELS[@]}" >&2
    echo "${WHEELS[*]}" >"$STAMP"
fi
for f in bin/nvcc nvvm/bin/cicc include/cuda_runtime.h include/crt/host_config.h; do
    if [ ! -e "$ROOT/$f" ]; then
        echo "gpu-build-env: $ROOT/$f missing (remove $PREFIX and run again)" >&2
        exit 1
    fi
done

# The unversioned names the linker looks for.
for lib in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
    if [ ! -e "$ROOT/lib/lib$lib" ]; then
        echo "gpu-build-env: $ROOT/lib/lib$lib missing" >&2
        exit 1
    fi
    ln -sf "lib$lib" "$ROOT/lib/lib${lib%.*}"
done

# The link stub for libcuda, from the functions cudarc declares.
if [ ! -e "$ROOT/lib/stubs/libcuda.so" ]; then
    CUDARC_DIR="$(cargo metadata --format-version 1 --locked --features cuda 2>/dev/null | "$PY" -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"]))
        break
')"
    if [ -z "$CUDARC_DIR" ] || [ ! -f "$CUDARC_DIR/src/driver/sys/mod.rs" ]; then
        echo "gpu-build-env: cudarc's sources not found (cargo fetch first)" >&2
        exit 1
    fi
    mkdir -p "$ROOT/lib/stubs"
    grep -oE '\bfn cu[A-Za-z0-9_]+\(' "$CUDARC_DIR/src/driver/sys/mod.rs" \
        | sed -E 's/^fn (.*)\($/int \1(void) { return 34; }/' | sort -u \
        >"$ROOT/lib/stubs/libcuda-stub.c"
    "${CC:-cc}" -shared -fPIC -fno-builtin -Wl,-soname,libcuda.so.1 \
        -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/libcuda-stub.c" >&2
fi
# Under its soname too: LD_LIBRARY_PATH=$TIDESTORE_CUDA13_LIB/stubs:... starts the binary
# on a machine without a driver (every CUDA call fails; the CPU path). Never with a driver.
ln -sf libcuda.so "$ROOT/lib/stubs/libcuda.so.1"

echo "export CUDA_HOME=\"$ROOT\""
echo "export CUDA_ROOT=\"$ROOT\""
echo "export CUDA_PATH=\"$ROOT\""
echo "export NVCC=\"$ROOT/bin/nvcc\""
echo "export PATH=\"$ROOT/bin:\$PATH\""
echo "export CUDA_COMPUTE_CAP=\"${CUDA_COMPUTE_CAP:-90}\""
# Where the runtime libraries are, for running the binary here (with a driver).
echo "export TIDESTORE_CUDA13_LIB=\"$ROOT/lib\""
