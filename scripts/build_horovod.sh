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
#                           torch depends on, linked shared with an rpath to it). With both frameworks and a
#                           TensorFlow without CUDA (tensorflow-cpu), the TensorFlow ops are built apart with Gloo
#                           and joined to the NCCL PyTorch ops in one wheel (two builds).
#   HOROVOD_BUILD_CUDA_CC_LIST  compute capabilities of the CUDA kernels; default: those of the GPUs nvidia-smi
#                           lists (Horovod's own default is every architecture nvcc knows, minutes longer).
#   MAKEFLAGS               default -j$(nproc).
# A CUDA build of torch makes Horovod compile its CUDA parts whatever HVD_SPARSE_GPU says: nvcc must be on PATH
# or under /usr/local/cuda (the toolkit: HOROVOD_CUDA_HOME, else CUDA_HOME, CUDA_PATH, /usr/local/cuda). CMake 4 refuses Gloo's cmake_minimum_required(2.8.12): CMAKE_POLICY_VERSION_MINIMUM
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

if [[ $GPU == nccl && " $FRAMEWORKS " == *" torch "* && " $FRAMEWORKS " == *" tensorflow "* ]] \
        && ! "$PY" -c 'import sys, tensorflow as tf; sys.exit(0 if tf.test.is_built_with_cuda() else 1)' 2>/dev/null; then
    # Horovod's TensorFlow ops built with CUDA need TensorFlow's GPU kernels, which tensorflow-cpu lacks (the library
    # does not load: undefined symbol tensorflow::functor::DenseUpdate<Eigen::GpuDevice, ...>). So the TensorFlow ops
    # are built with Gloo alone, the PyTorch ops with NCCL, and the two extensions (each holds its own copy of
    # Horovod's core) go into one wheel, with both frameworks in its metadata.json.
    HVD_SPARSE_FRAMEWORKS=tensorflow HVD_SPARSE_GPU=none bash "$0" "$SDIST" "$work/tf" "$PY"
    HVD_SPARSE_FRAMEWORKS=torch bash "$0" "$SDIST" "$work/torch" "$PY"
    "$PY" -m wheel unpack -d "$work/tf" "$work/tf"/horovod-*.whl >/dev/null
    "$PY" -m wheel unpack -d "$work/torch" "$work/torch"/horovod-*.whl >/dev/null
    tf=$(echo "$work"/tf/horovod-*/) torch=$(echo "$work"/torch/horovod-*/)
    cp "$tf"/horovod/tensorflow/mpi_lib*.so "$torch/horovod/tensorflow/"
    "$PY" - "$tf/horovod/metadata.json" "$torch/horovod/metadata.json" <<'EOF'
import json, sys
merged = {**json.load(open(sys.argv[1])), **json.load(open(sys.argv[2]))}
json.dump(merged, open(sys.argv[2], "w"))
EOF
    "$PY" -m wheel pack -d "$WHEELDIR" "$torch" >/dev/null
    echo "[build_horovod] one wheel: PyTorch ops with NCCL, TensorFlow ops with Gloo (tensorflow-cpu)" >&2
    exit 0
fi

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
    # the toolkit's root (headers, cudart): an nvcc on PATH may be a wrapper script elsewhere (/usr/local/bin)
    cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
    [[ -z "$cuda_home" && -x /usr/local/cuda/bin/nvcc ]] && cuda_home=/usr/local/cuda
    export HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-${cuda_home:-$(dirname "$(dirname "$(realpath "$(command -v nvcc)")")")}}
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
