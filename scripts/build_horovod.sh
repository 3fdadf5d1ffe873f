#!/usr/bin/env bash
# Build a Horovod 0.28.1 wheel from its PyPI sdist, patched with patches/horovod-0.28.1.patch.
#
#   scripts/build_horovod.sh SDIST WHEELDIR PYTHON
#
# SDIST: horovod-0.28.1.tar.gz; WHEELDIR: where the wheel goes; PYTHON: the interpreter whose torch (and
# TensorFlow) the ops are built against. Used by scripts/setup_env.sh (`make test`, `make demo`) and by
# scripts/gpu_check.sh (offline, on a GPU machine). Needs no network.
#
# Environment:
#   HVD_SPARSE_FRAMEWORKS   "torch tensorflow" (default) or "torch": the framework ops to build.
#   HVD_SPARSE_GPU          "none" (default: CPU operations by Gloo; CUDA tensors travel through the host) or
#                           "nccl" (HOROVOD_GPU_OPERATIONS=NCCL, NCCL from the nvidia-nccl wheel that a CUDA
#                           torch depends on, linked shared with an rpath to it).
#   HOROVOD_BUILD_CUDA_CC_LIST  compute capabilities of the CUDA kernels; default: those of the GPUs nvidia-smi
#                           lists (Horovod's own default is every architecture nvcc knows, minutes longer).
#   MAKEFLAGS               default -j$(nproc).
# A CUDA build of torch makes Horovod compile its CUDA parts whatever HVD_SPARSE_GPU says: nvcc must be on PATH
# or under /usr/local/cuda. CMake 4 refuses Gloo's cmake_minimum_required(2.8.12): CMAKE_POLICY_VERSION_MINIMUM
# is set to 3.5 (older CMake ignores it).
set -euo pipefail

SDIST=$(realpath "$1")
WHEELDIR=$(mkdir -p "$2" && realpath "$2")
PY=$3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCH=$ROOT/patches/horovod-0.28.1.patch
FRAMEWORKS=${HVD_SPARSE_FRAMEWORKS:-torch tensorflow}
GPU=${HVD_SPARSE_GPU:-none}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$SDIST" -C "$work"
src=$(echo "$work"/horovod-*)
(cd "$src" && patch -p1 -s < "$PATCH")

export HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO
export CMAKE_POLICY_VERSION_MINIMUM=3.5
export MAKEFLAGS=${MAKEFLAGS:--j$(env -u OMP_NUM_THREADS nproc)}   # nproc obeys OMP_NUM_THREADS
case " $FRAMEWORKS " in *" torch "*) export HOROVOD_WITH_PYTORCH=1 ;; *) export HOROVOD_WITHOUT_PYTORCH=1 ;; esac
case " $FRAMEWORKS " in
    *" tensorflow "*) export HOROVOD_WITH_TENSORFLOW=1 ;;
    *) export HOROVOD_WITHOUT_TENSORFLOW=1 ;;
esac

if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
if command -v nvcc >/dev/null; then
    export HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
    if [[ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]] && command -v nvidia-smi >/dev/null; then
        ccs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d . | sort -u | paste -sd, -)
        [[ -n "$ccs" ]] && export HOROVOD_BUILD_CUDA_CC_LIST=$ccs
    fi
fi

case $GPU in
    none) ;;
    nccl)
        # NCCL as the CUDA torch wheel brings it (nvidia-nccl-cu*): include/nccl.h and lib/libnccl.so.2, which
        # CMake's find_library only finds as libnccl.so -- hence a folder with that name beside the headers.
        nccl=$("$PY" -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])")
        mkdir -p "$work/nccl/lib"
        ln -s "$nccl/include" "$work/nccl/include"
        ln -s "$nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
        export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=$work/nccl HOROVOD_NCCL_LINK=SHARED
        export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$nccl/lib"
        ;;
    *) echo "build_horovod.sh: HVD_SPARSE_GPU must be none or nccl, got '$GPU'" >&2; exit 2 ;;
esac

echo "[build_horovod] frameworks: $FRAMEWORKS; GPU operations: $GPU; CUDA archs: ${HOROVOD_BUILD_CUDA_CC_LIST:-none}" >&2
"$PY" -m pip --disable-pip-version-check -q wheel --no-build-isolation --no-deps --no-index -w "$WHEELDIR" "$src"
