#!/usr/bin/env bash
# Build the project's virtualenv (.venv/) from nothing, idempotently.
#
#   scripts/setup_env.sh            # what `make venv` (and so `make test` / `make demo`) runs
#
# 1. Debian packages the Horovod build needs (g++, cmake, make, patch), and those of the tests (iproute2 for the
#    network namespaces, openssh-server for the multi-host horovodrun test), installed only when missing.
# 2. .venv with the pinned frameworks: torch==2.13.0, tensorflow-cpu==2.21.0 + tf-keras==2.21.0, and the project
#    with its dev and ray extras (pytest, hypothesis, scikit-learn, scipy, matplotlib; Ray for the horovod.ray
#    tests).
# 3. Horovod 0.28.1 from its PyPI sdist, patched with patches/horovod-0.28.1.patch and built by
#    scripts/build_horovod.sh with Gloo + PyTorch + TensorFlow ops, no MPI. The built wheel is cached in
#    $HVD_SPARSE_CACHE (default ~/.cache/hvd_sparse/wheels) under a key of the patch, the build script, the
#    framework versions and the GPU mode, so a second run -- or a fresh clone on the same machine -- never
#    rebuilds it.
#
# GPU machines. Where `nvidia-smi -L` lists a GPU (or HVD_SPARSE_GPU=nccl is set), torch must be a CUDA build
# (PyPI's torch==2.13.0 for Linux is one; the script stops with a message if it is not) and Horovod is built with
# HOROVOD_GPU_OPERATIONS=NCCL, NCCL from the nvidia-nccl wheel that torch depends on; nvcc (the CUDA toolkit)
# must be on PATH or in /usr/local/cuda. HVD_SPARSE_GPU=none keeps the CPU build (Gloo for everything: CUDA
# tensors travel through the host), which is what two ranks sharing one GPU need (NCCL refuses that).
# Elsewhere nothing changes. docs/gpu.md has the details.
#
# A stamp file (.venv/.hvd_sparse-stamp) holds the hash of every input above; when it matches, the
# script does nothing and exits in well under a second.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
CACHE=${HVD_SPARSE_CACHE:-$HOME/.cache/hvd_sparse/wheels}

TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
HOROVOD_VERSION=0.28.1
PATCH=$ROOT/patches/horovod-$HOROVOD_VERSION.patch
BUILD=$ROOT/scripts/build_horovod.sh
if [[ -z "${HVD_SPARSE_GPU:-}" ]]; then
    HVD_SPARSE_GPU=none
    if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
        HVD_SPARSE_GPU=nccl
    fi
fi
export HVD_SPARSE_GPU

inputs_hash() {
    (cat "$0" "$PATCH" "$BUILD" setup.cfg setup.py; echo "gpu=$HVD_SPARSE_GPU") | sha256sum | cut -c1-16
}
STAMP="$VENV/.hvd_sparse-stamp"
WANT=$(inputs_hash)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# ---- 1. system packages ------------------------------------------------------------------------------
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v make >/dev/null || missing+=(make)
command -v patch >/dev/null || missing+=(patch)
command -v ip >/dev/null || missing+=(iproute2)
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)          # brings ssh and ssh-keygen (openssh-client)
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup_env.sh: missing system packages: ${missing[*]} (run as root, or apt-get install them)" >&2
        exit 1
    fi
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# ---- 2. virtualenv and frameworks ---------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check -q)
log "installing torch==$TORCH_VERSION, tensorflow-cpu==$TF_VERSION, tf-keras==$TF_VERSION"
"${PIP[@]}" install --upgrade "pip>=23" "setuptools<81" wheel
"${PIP[@]}" install "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" "tf-keras==$TF_VERSION" \
    cloudpickle psutil pyyaml packaging cffi
if [[ $HVD_SPARSE_GPU != none ]] && ! "$VPY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
    echo "setup_env.sh: HVD_SPARSE_GPU=$HVD_SPARSE_GPU, but torch==$TORCH_VERSION in $VENV is not a CUDA build;" \
         "install a CUDA build of it there (pip install torch==$TORCH_VERSION --index-url" \
         "https://download.pytorch.org/whl/cu128), or set HVD_SPARSE_GPU=none for the CPU build" >&2
    exit 1
fi

# ---- 3. Horovod from the patched sdist, wheel cached ---------------------------------------------------
have_horovod() {
    "$VPY" - <<'EOF' 2>/dev/null
import horovod, os, sys
from horovod.common.util import extension_available, gloo_built, nccl_built
ok = (horovod.__version__ == "0.28.1" and gloo_built()
      and extension_available("torch") and extension_available("tensorflow"))
if os.environ["HVD_SPARSE_GPU"] == "nccl":
    ok = ok and bool(nccl_built())
sys.exit(0 if ok else 1)
EOF
}
if ! have_horovod; then
    KEY=$( (cat "$PATCH" "$BUILD"; echo "torch=$TORCH_VERSION tf=$TF_VERSION gpu=$HVD_SPARSE_GPU" \
            "py=$("$VPY" -c 'import sys, torch; print(sys.version_info[:2], torch.version.cuda)')") \
           | sha256sum | cut -c1-12)
    WHEELDIR="$CACHE/horovod-$HOROVOD_VERSION-$KEY"
    if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (Gloo, PyTorch, TensorFlow; GPU operations: $HVD_SPARSE_GPU;" \
            "about 5 minutes on 2 cores, once per machine)"
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        "${PIP[@]}" download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
        rm -rf "$WHEELDIR.tmp"
        bash "$BUILD" "$work/horovod-$HOROVOD_VERSION.tar.gz" "$WHEELDIR.tmp" "$VPY"
        rm -rf "$WHEELDIR" && mv "$WHEELDIR.tmp" "$WHEELDIR"
    else
        log "using cached Horovod wheel $WHEELDIR"
    fi
    "${PIP[@]}" install --no-deps --force-reinstall "$WHEELDIR"/horovod-*.whl
    have_horovod || { echo "setup_env.sh: Horovod installed but its Gloo/torch/tensorflow extensions" \
                           "(or NCCL, HVD_SPARSE_GPU=$HVD_SPARSE_GPU) are missing" >&2; exit 1; }
fi

# ---- 4. the project itself ------------------------------------------------------------------------------
log "installing hvd_sparse (editable) with dev and ray extras"
"${PIP[@]}" install --no-build-isolation -e ".[dev,ray]"

echo "$WANT" > "$STAMP"
log "ready: $VENV"
