#!/usr/bin/env bash
# Build the project's virtualenv (.venv/) from nothing, idempotently.
#
#   scripts/setup_env.sh            # what `make venv` (and so `make test` / `make demo`) runs
#
# 1. Debian packages the Horovod build needs (g++, cmake, make, patch), and those of the tests (iproute2 for the
#    network namespaces, openssh-server for the multi-host horovodrun test), installed only when missing.
# 2. .venv with the pinned frameworks: torch==2.13.0 (CPU wheel), tensorflow-cpu==2.21.0 + tf-keras==2.21.0,
#    and the project with its dev and ray extras (pytest, hypothesis, scikit-learn, scipy, matplotlib; Ray for
#    the horovod.ray tests).
# 3. Horovod 0.28.1 from its PyPI sdist, patched with patches/horovod-0.28.1.patch (see the patch header)
#    and built with Gloo + PyTorch + TensorFlow ops, no MPI. The built wheel is cached in
#    $HVD_SPARSE_CACHE (default ~/.cache/hvd_sparse/wheels) under a key of the patch's hash and the
#    framework versions, so a second run -- or a fresh clone on the same machine -- never rebuilds it.
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

inputs_hash() {
    cat "$0" "$PATCH" setup.cfg setup.py | sha256sum | cut -c1-16
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

# ---- 3. Horovod from the patched sdist, wheel cached ---------------------------------------------------
have_horovod() {
    "$VPY" - <<'EOF' 2>/dev/null
import horovod, sys
from horovod.common.util import gloo_built, extension_available
ok = (horovod.__version__ == "0.28.1" and gloo_built()
      and extension_available("torch") and extension_available("tensorflow"))
sys.exit(0 if ok else 1)
EOF
}
if ! have_horovod; then
    KEY=$( (cat "$PATCH"; echo "torch=$TORCH_VERSION tf=$TF_VERSION py=$("$VPY" -c 'import sys;print(sys.version_info[:2])')") \
           | sha256sum | cut -c1-12)
    WHEELDIR="$CACHE/horovod-$HOROVOD_VERSION-$KEY"
    if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (Gloo, PyTorch, TensorFlow; about 5 minutes, once per machine)"
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        "${PIP[@]}" download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
        tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
        (cd "$work/horovod-$HOROVOD_VERSION" && patch -p1 -s < "$PATCH")
        mkdir -p "$WHEELDIR.tmp"
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
        MAKEFLAGS="-j$(nproc)" \
            "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$WHEELDIR.tmp" "$work/horovod-$HOROVOD_VERSION"
        rm -rf "$WHEELDIR" && mv "$WHEELDIR.tmp" "$WHEELDIR"
    else
        log "using cached Horovod wheel $WHEELDIR"
    fi
    "${PIP[@]}" install --no-deps --force-reinstall "$WHEELDIR"/horovod-*.whl
    have_horovod || { echo "setup_env.sh: Horovod installed but its Gloo/torch/tensorflow extensions are missing" >&2; exit 1; }
fi

# ---- 4. the project itself ------------------------------------------------------------------------------
log "installing hvd_sparse (editable) with dev and ray extras"
"${PIP[@]}" install --no-build-isolation -e ".[dev,ray]"

echo "$WANT" > "$STAMP"
log "ready: $VENV"
