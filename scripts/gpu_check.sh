#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, CUDA's nvcc and a CUDA build of PyTorch -- and no network --
# build Horovod, run the CUDA tests and the GPU benchmarks, and put every log and report into one folder.
#
#   scripts/gpu_check.sh [OUTDIR]            # default: gpu_check/ (about 6 minutes on 16 cores, H100/H200)
#   scripts/gpu_check.sh --fetch [DIR]       # on a machine with network: fetch what it needs into DIR
#
# What it needs lies in $HVD_SPARSE_OFFLINE (default .offline/, ignored by git):
#   horovod-0.28.1.tar.gz       Horovod's sdist
#   *.whl                       Python packages the GPU machine lacks: cffi and pycparser (Horovod's build imports
#                               cffi). `--fetch` downloads them for $GPU_PYTHON (default 3.12), manylinux x86-64.
#   horovod-gloo/*.whl, horovod-nccl/*.whl   optional: the wheels an earlier run left in OUTDIR/wheels; given, they
#                               are installed instead of building again (the build is most of the time).
# Optional:
#   HVD_SPARSE_BASELINE=DIR     a tree of an earlier commit (at least its hvd_sparse/): bench trainstep and bench
#                               engine then run alternately on it and on this tree, in pairs, so that before and
#                               after come from one run on one card (reports *_base_N.json beside *_N.json)
#   HVD_SPARSE_GPU_CHECK_NCCL=0 skip the NCCL build and its steps (the Gloo build then gets every core)
#   HVD_SPARSE_GPU_CHECK_STEPS=tests,bench_trainstep,...   run only the steps named (versions and the builds always
#                               run): a run sized to a short lease
# python3 must be the GPU machine's Python with torch (CUDA), numpy, scipy, pytest, hypothesis, scikit-learn and
# matplotlib; nothing is installed into it: Horovod and the wheels go to folders under /tmp, on PYTHONPATH.
#
# Steps (a failing step is logged and the next runs; the exit code is non-zero if any failed):
#   1. versions     the card, driver, CUDA, torch, compilers
#   2. build        Horovod for PyTorch twice, in parallel (scripts/build_horovod.sh): Gloo (CUDA tensors through
#                   the host: what two ranks on one GPU need) and NCCL (HOROVOD_GPU_OPERATIONS=NCCL)
#   3. tests        pytest -m cuda with the Gloo build: the engine on CUDA against the numpy simulator, and
#                   float32/bf16/fp16/mixed models through horovodrun -np 2 on the one GPU
#   4. nccl         the NCCL build: horovodrun --check-build, the CUDA smoke job at -np 1 and at -np 2 (with one GPU
#                   the two ranks share it, which NCCL refuses: recorded, not counted as a failure)
#   5. benchmarks   bench trainstep (25M MLP, 2 ranks on the GPU, Gloo build; then again with
#                   HOROVOD_CYCLE_TIME=0.1 ms; and the presets with and without overlap=True), bench engine
#                   --device cuda (25M) -- trainstep and engine in pairs with the
#                   baseline when HVD_SPARSE_BASELINE is set --, bench advise (under horovodrun -np 2, 25M MLP),
#                   bench latency (one small collective, 2 and 4 ranks), bench select --device cuda (25M, 100M)
# OUTDIR then holds summary.txt (one line per step: exit code, seconds), logs/, reports/ (JSON, Markdown, PNG) and
# wheels/ (the Horovod wheels built, for the next run). After every step, an archive of summary.txt, logs/ and
# reports/ is written to $HVD_SPARSE_GPU_CHECK_ARCHIVE (default OUTDIR.tar.gz), so a run cut short keeps its logs.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OFFLINE=${HVD_SPARSE_OFFLINE:-$ROOT/.offline}
PY=${PYTHON:-python3}
BASE=${HVD_SPARSE_BASELINE:-}
NCCL=${HVD_SPARSE_GPU_CHECK_NCCL:-1}

if [[ "${1:-}" == "--fetch" ]]; then
    dest=${2:-$OFFLINE}
    mkdir -p "$dest"
    pip download --no-deps --no-binary :all: -d "$dest" horovod==0.28.1
    pip download --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" cffi pycparser
    exit 0
fi

OUT=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
ARCHIVE=${HVD_SPARSE_GPU_CHECK_ARCHIVE:-$OUT.tar.gz}
mkdir -p "$OUT/logs" "$OUT/reports" "$OUT/wheels"
: > "$OUT/summary.txt"
failed=0
STEPS=${HVD_SPARSE_GPU_CHECK_STEPS:-}
step() {         # step NAME COMMAND...: run it, log to logs/NAME.log, one summary line, archive
    local name=$1 start=$SECONDS rc
    shift
    if [[ -n $STEPS && ! ,$STEPS, == *,$name,* && $name != versions && $name != build_* ]]; then
        echo "$name: skipped" | tee -a "$OUT/summary.txt"
        return 0
    fi
    "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $((SECONDS - start)) s${NOTE:+ ($NOTE)}" | tee -a "$OUT/summary.txt"
    tar czf "$ARCHIVE.$BASHPID" -C "$OUT" summary.txt logs reports && mv "$ARCHIVE.$BASHPID" "$ARCHIVE"
    ((rc == 0)) || [[ -n "${NOTE:-}" ]] || failed=1
    return $rc
}

SITE=/tmp/hvd_sparse_site
rm -rf "$SITE" && mkdir -p "$SITE"
if ls "$OFFLINE"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$OFFLINE"/*.whl
fi
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
CORES=$(env -u OMP_NUM_THREADS nproc)            # before OMP_NUM_THREADS=1, which nproc obeys
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

versions() {
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
    "$PY" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "numpy", numpy.__version__,
"device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
    "$PY" -c 'import nvidia.nccl, torch; print("nccl", torch.cuda.nccl.version(), list(nvidia.nccl.__path__))'
    nvcc --version || /usr/local/cuda/bin/nvcc --version
    gcc --version | head -1; cmake --version | head -1; echo "cores: $CORES"; uptime
}
step versions versions

build() {        # build gloo|nccl: the wheel in OUTDIR/wheels/<kind>, reused from the offline folder if there
    local kind=$1
    if ls "$OFFLINE/horovod-$kind"/horovod-*.whl >/dev/null 2>&1; then
        mkdir -p "$OUT/wheels/$kind" && cp -v "$OFFLINE/horovod-$kind"/horovod-*.whl "$OUT/wheels/$kind/"
        return
    fi
    # -s: no debug information in the libraries (the wheel is then small enough to carry back)
    HVD_SPARSE_FRAMEWORKS=torch HVD_SPARSE_GPU=$([[ $kind == gloo ]] && echo none || echo nccl) \
        MAKEFLAGS=-j$(( NCCL == 0 ? CORES : CORES / 2 > 1 ? CORES / 2 : 1 )) LDFLAGS="-s" \
        bash "$ROOT/scripts/build_horovod.sh" "$OFFLINE/horovod-0.28.1.tar.gz" "$OUT/wheels/$kind" "$PY"
}
if [[ $NCCL == 0 ]]; then
    step build_gloo build gloo || failed=1
else
    step build_gloo build gloo & gloo_pid=$!
    step build_nccl build nccl & nccl_pid=$!
    wait $gloo_pid || failed=1
    wait $nccl_pid || failed=1
fi

use() {          # use gloo|nccl: that build's Horovod first on PYTHONPATH and PATH
    local dir=/tmp/hvd_sparse_horovod_$1
    if [[ ! -d $dir ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$dir" "$OUT/wheels/$1"/horovod-*.whl || return 1
    fi
    export PYTHONPATH=$dir:$ROOT:$SITE PATH=$dir/bin:$PATH HVD_DIR=$dir
}

pairs() {        # pairs SECONDS REPORT BENCH ARGS...: the benchmark on this tree, then on the baseline if given, twice
    local limit=$1 report=$2 i
    shift 2
    for i in 1 2; do
        timeout "$limit" "$PY" -m hvd_sparse.bench "$@" --json "$OUT/reports/${report}_$i.json" || return
        [[ -z $BASE ]] && return
        # from the baseline's folder: `python -m` puts the working directory first on sys.path
        (cd "$BASE" && PYTHONPATH=$HVD_DIR:$BASE:$SITE timeout "$limit" "$PY" -m hvd_sparse.bench "$@" \
            --json "$OUT/reports/${report}_base_$i.json") || return
    done
}

if use gloo; then
    step tests timeout 300 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs "$ROOT/tests/core/test_cuda.py" \
        "$ROOT/tests/torch/test_dtypes_horovod.py" "$ROOT/tests/bench/test_bench_steps.py"
    step bench_trainstep pairs 150 trainstep trainstep --workers 2 --device cuda
    step bench_advise timeout 150 horovodrun -np 2 -H localhost:2 --gloo "$PY" -m hvd_sparse.bench advise \
        --device cuda --numel 25000000 --steps 3 --warmup 3 --seconds 30 --json "$OUT/reports/advise.json" \
        --markdown "$OUT/reports/advise.md"
    step bench_trainstep_cycle timeout 150 env HOROVOD_CYCLE_TIME=0.1 "$PY" -m hvd_sparse.bench trainstep \
        --workers 2 --device cuda --json "$OUT/reports/trainstep_cycle0.1.json"
    step bench_trainstep_overlap timeout 150 "$PY" -m hvd_sparse.bench trainstep --workers 2 --device cuda \
        --algorithms compute,topka,topka+o,exdyna,exdyna+o,oktopk,oktopk+o \
        --json "$OUT/reports/trainstep_overlap.json"
    step bench_engine pairs 150 engine engine --device cuda --numel 25000000
    step bench_latency timeout 150 "$PY" -m hvd_sparse.bench latency --workers 2,4 --cycle-times default,0.1 \
        --json "$OUT/reports/latency.json"
fi
step bench_select_25M "$PY" -m hvd_sparse.bench select --device cuda --numel 25000000 --repeat 10 \
    --json "$OUT/reports/select_25M.json" --plot "$OUT/reports/select_25M.png"
step bench_select_100M "$PY" -m hvd_sparse.bench select --device cuda --numel 100000000 --repeat 10 \
    --json "$OUT/reports/select_100M.json"

if [[ $NCCL != 0 ]] && use nccl; then
    step nccl_check_build horovodrun --check-build
    step nccl_np1 timeout 120 horovodrun -np 1 -H localhost:1 --gloo "$PY" "$ROOT/tests/hvd_workers/gpu_smoke_worker.py"
    # two ranks: on two GPUs a check like the others; on one GPU NCCL refuses (recorded, not counted as a failure)
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    NOTE=$( ((gpus < 2)) && echo "informational: $gpus GPU, two ranks share it") \
        step nccl_np2 timeout 60 horovodrun -np 2 -H localhost:2 --gloo "$PY" "$ROOT/tests/hvd_workers/gpu_smoke_worker.py"
fi

for log in "$OUT"/logs/bench_*.log; do          # the Markdown tables, for reading without JSON
    sed -n '/^Selection on one rank\|^Engine step\|^Training step\|^One small/,$p' "$log" \
        > "$OUT/reports/$(basename "$log" .log).md"
done
tar czf "$ARCHIVE" -C "$OUT" summary.txt logs reports
echo "gpu_check: $( ((failed)) && echo "some steps FAILED" || echo "every step passed"); see $OUT/summary.txt"
exit $failed
