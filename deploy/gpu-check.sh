#!/usr/bin/env bash
# sensai on one GPU, end to end, with no network: train, decompose, bench, one table.
#
#   deploy/gpu-check.sh OUT             # on the GPU machine, from the repository root
#   deploy/gpu-check.sh OUT --tiny      # the same steps on the CPU with tiny settings (the tests)
#   deploy/gpu-check.sh --fetch         # on a machine WITH network: fill deploy/gpu-bundle/
#
# The bundle (deploy/gpu-bundle/, or $SENSAI_GPU_BUNDLE) holds what a GPU image with torch,
# numpy, onnx, onnxruntime, safetensors, pillow, scikit-learn, httpx and tqdm lacks:
#   wheels/         the web stack, the pruning library and pytest for Python 3.12 x86_64
#                   (deploy/gpu-requirements.txt), installed offline into OUT/site, put on
#                   PYTHONPATH before the machine's own packages (its torch included);
#   fashion-mnist/  the four .gz files of the Debian package dataset-fashion-mnist.
# Where the running Python already imports all of it (this repository's .venv), nothing is
# installed.
#
# Steps, most wanted first (each timed in OUT/gpu-check.log; none starts after
# $SENSAI_GPU_CHECK_DEADLINE_S seconds, default 480, so that the table comes within 9 minutes):
#   1. train VGG-16-bn on Fashion-MNIST (3 epochs) on the GPU;
#   2. decompose it at G=2 with the defaults, retraining on the GPU (in process: no Ray);
#   2b. the sensAI paper's regime: decompose it into subnets 20x smaller (--shrink 20) at G=2
#      and at G=10, each cut off after $SENSAI_GPU_CHECK_OFFLINE_S seconds (default 150);
#   3. under load: `sensai bench-load --sweep` of the decomposed artifact and of the original
#      behind the same gateway, KServe v2 tensors from four client processes on four cores of
#      their own (the server on the others), twice:
#      with the automatic count of gateway processes (OUT/load: closed loops at 1-64 in flight,
#      then an overload), then with one (OUT/load-n1, SENSAI_GATEWAY_REPLICAS=1: a shorter
#      sweep, 1 4 16 64 in flight and no overload, so the two still fit the 9 minutes); the
#      machine's cores go to the log, the GPU's busy share (nvidia-smi, every 0.5 s) to
#      OUT/<sweep>/gpu-util.csv;
#   4. bench single device, model parallel and class parallel on CUDA graphs, in process and
#      through the real gateway over HTTP (PNG upload, KServe v2 tensor);
#   5. the GPU tests (tests/test_graphs.py);
#   6. the same latency comparison on a latency-only VGG-16-bn artifact at 224x224
#      (1 training epoch on a few hundred images, --policy keep, no retraining);
#   7. steps 4 and 6 on eager torch;
#   8. one table: OUT/gpu-check.md (bench.json / bench.md of every run under OUT/<run>/, and the
#      sweeps' OUT/load/load.md and OUT/load-n1/load.md, and the offline work: each training's
#      and decomposition's time, images/s and accuracy beside the original's); a step skipped or
#      failed is a line of it, so the table comes whatever ran.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=${SENSAI_GPU_BUNDLE:-$REPO/deploy/gpu-bundle}

if [[ ${1:-} == --fetch ]]; then
    set -e
    mkdir -p "$BUNDLE/wheels" "$BUNDLE/fashion-mnist"
    pip download -d "$BUNDLE/wheels" --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 \
        $(grep -v -e '^#' -e '^torch-pruning' "$REPO/deploy/gpu-requirements.txt")
    # Its own dependencies (torch, numpy) are the GPU image's.
    pip download -d "$BUNDLE/wheels" --no-deps --only-binary=:all: torch-pruning
    cp /usr/share/datasets/fashion-mnist/*.gz "$BUNDLE/fashion-mnist/"
    echo "bundle ready: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1))"
    exit 0
fi

OUT=${1:?usage: deploy/gpu-check.sh OUT [--tiny] | --fetch}
TINY=0
[[ ${2:-} == --tiny ]] && TINY=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Away from the repository root, whose sensai/ folder would shadow the installed package.
cd "$OUT"
LOG=$OUT/gpu-check.log
: > "$LOG"
FAILED=()
T0=$(date +%s)
# Steps that would start later than this are skipped (the table is still written).
DEADLINE_S=${SENSAI_GPU_CHECK_DEADLINE_S:-480}

say() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# step NAME CMD...: run, log, time; a failed step is reported at the end and the rest go on.
step() {
    local name=$1; shift
    local t=$(date +%s)
    if [[ $name != report ]] && (( t - T0 > DEADLINE_S )); then
        say "$name: SKIPPED (past the ${DEADLINE_S} s deadline)"
        FAILED+=("$name")
        return 1
    fi
    say "$name: $*"
    if "$@" >>"$LOG" 2>&1; then
        say "$name: done in $(( $(date +%s) - t )) s"
    else
        say "$name: FAILED after $(( $(date +%s) - t )) s (see $LOG)"
        FAILED+=("$name")
        return 1
    fi
}

# --- Python: this one if it has everything, else the bundle's wheels beside it.
PY=${PYTHON:-python3}
[[ -x $REPO/.venv/bin/python ]] && PY=$REPO/.venv/bin/python
NEEDED="import fastapi, uvicorn, pydantic_settings, multipart, torch_pruning, pytest, sensai.serving.gateway.app"
if ! "$PY" -c "$NEEDED" 2>/dev/null; then
    [[ -d $BUNDLE/wheels ]] || { say "no $BUNDLE/wheels: run 'deploy/gpu-check.sh --fetch' on a machine with network"; exit 2; }
    # Into a folder on PYTHONPATH rather than a venv: the machine's torch may live where a
    # venv does not look (a distribution's dist-packages, a user site).
    SITE=$OUT/site
    step wheels "$PY" -m pip install -q --no-index --find-links "$BUNDLE/wheels" --target "$SITE" \
        $(grep -v -e '^#' -e '^torch-pruning' -e '^setuptools' "$REPO/deploy/gpu-requirements.txt") || exit 2
    # Its own dependencies (torch, numpy) are the machine's.
    step torch-pruning "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE/wheels" \
        --target "$SITE" torch-pruning || exit 2
    # setuptools only builds sensai: it stays off the path the runs use (torch pins its own).
    step setuptools "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE/wheels" \
        --target "$OUT/build-tools" setuptools || exit 2
    step sensai env PYTHONPATH="$OUT/build-tools" "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation --target "$SITE" "$REPO" || exit 2
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "$NEEDED" >>"$LOG" 2>&1 || { say "the environment still lacks a package (see $LOG)"; exit 2; }
fi
SENSAI=("$PY" -m sensai)
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" | tee -a "$LOG"

FMNIST=/usr/share/datasets/fashion-mnist
[[ -f $FMNIST/train-images-idx3-ubyte.gz ]] || FMNIST=$BUNDLE/fashion-mnist

if (( TINY )); then
    DEVICE=cpu RUNTIMES=torch MODEL=fmnist_cnn SIZE=32
    TRAIN=(--epochs 1 --train-limit 600)
    DECOMPOSE=(--retrain-epochs 1 --samples-per-subnet 256 --features-per-class 10 --stats-per-class 20 --eval-limit 200)
    BENCH=(--images 8 --warmup 2 --rounds 1 --concurrency 2 --requests 8)
    LOAD=(--configs class-parallel single --levels 1 2 --level-seconds 1 --warmup-seconds 1
          --overload-seconds 1 --images 8)
    LOAD_N1=("${LOAD[@]}")
    PER_CLASS=6
else
    DEVICE=cuda RUNTIMES="cuda-graph torch" MODEL=vgg16_bn SIZE=224
    TRAIN=(--epochs 3)
    DECOMPOSE=()
    BENCH=(--images 200)
    # Batching against none was measured on an H100 once (BENCHMARKS.md); leaving it out lets
    # the batch-1 bench start before the deadline on a machine as slow as that one.
    # Four client processes on four cores of their own, the server on the others.
    LOAD=(--configs class-parallel single --levels 1 2 4 8 16 32 64
          --level-seconds 2 --overload-seconds 5 --clients 4 --client-cores 4)
    # One gateway process, against the automatic count: four levels, a shorter warm-up and no
    # overload (about half a minute less than the first sweep), so that both fit the 9 minutes.
    LOAD_N1=(--configs class-parallel single --levels 1 4 16 64 --level-seconds 2
             --warmup-seconds 2 --overload-seconds 0 --clients 4 --client-cores 4)
    PER_CLASS=30
fi
STRATS=(--strategies single model-parallel class-parallel)

# --- 1-2: the flagship, trained and decomposed on the device.
step train "${SENSAI[@]}" train --model "$MODEL" --data-dir "$FMNIST" "${TRAIN[@]}" \
    --device "$DEVICE" --out "$OUT/models/$MODEL"
step decompose "${SENSAI[@]}" decompose --model-dir "$OUT/models/$MODEL" --groups 2 \
    --device "$DEVICE" --no-ray "${DECOMPOSE[@]}" --out "$OUT/models/${MODEL}_g2"
# --- 2b: subnets 20x smaller, at G=2 and G=10; capped, so a slow one cannot take the rest.
OFFLINE_S=${SENSAI_GPU_CHECK_OFFLINE_S:-150}
for G in 2 10; do
    step "decompose-x20-g$G" timeout "$OFFLINE_S" "${SENSAI[@]}" decompose \
        --model-dir "$OUT/models/$MODEL" --groups "$G" --shrink 20 --device "$DEVICE" --no-ray \
        "${DECOMPOSE[@]}" --out "$OUT/models/${MODEL}_g${G}_x20"
done

# --- 3: under load (the gateway picks the device itself: --device auto), with the automatic
# count of gateway processes (1 under 4 cores, else half the cores, at most 8), then with one.
# load_sweep NAME DIR ARGS...: one sweep into DIR, the GPU's utilisation sampled meanwhile.
say "cores: $(nproc) usable (nproc), $(nproc --all) in all"
load_sweep() {
    local name=$1 dir=$2 smi=; shift 2
    mkdir -p "$dir"
    if (( $(date +%s) - T0 <= DEADLINE_S )) && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 \
            >"$dir/gpu-util.csv" 2>>"$LOG" &
        smi=$!
    fi
    step "$name" "${SENSAI[@]}" bench-load "$OUT/models/${MODEL}_g2" --out "$dir" --sweep \
        --transport http-v2 "$@" --no-progress
    local rc=$?
    if [[ -n $smi ]]; then
        kill "$smi" 2>/dev/null
        wait "$smi" 2>/dev/null
    fi
    return $rc
}
load_sweep load-sweep "$OUT/load" "${LOAD[@]}"
load_sweep load-sweep-n1 "$OUT/load-n1" "${LOAD_N1[@]}" --env SENSAI_GATEWAY_REPLICAS=1

# bench_flagship RUNTIME, bench_224 RUNTIME: the latency comparison, in process and through the
# real gateway.
bench_flagship() {
    step "bench-fmnist-$1" "${SENSAI[@]}" bench "$OUT/models/${MODEL}_g2" --device "$DEVICE" \
        --runtime "$1" "${STRATS[@]}" --transports inprocess http http-v2 "${BENCH[@]}" \
        --no-progress --out "$OUT/fmnist_$1"
}
bench_224() {
    step "bench-${SIZE}-$1" "${SENSAI[@]}" bench "$OUT/models/${MODEL}_${SIZE}_g2" \
        --device "$DEVICE" --runtime "$1" "${STRATS[@]}" --transports inprocess http-v2 \
        "${BENCH[@]}" --no-progress --out "$OUT/${SIZE}_$1"
}
FIRST=${RUNTIMES%% *} REST=${RUNTIMES#"$FIRST"}

# --- 4-5: the default runtime (graphs on a GPU), then the tests that need a GPU (they skip on
# a CPU).
bench_flagship "$FIRST"
(( TINY )) || step gpu-tests env SENSAI_FMNIST_DIR="$FMNIST" "$PY" -m pytest -q --import-mode=importlib \
    -p no:cacheprovider "$REPO/tests/test_graphs.py"

# --- 6: the latency-only artifact at 224x224 (compute rather than launches).
step imagefolder "$PY" "$REPO/deploy/gpu_check.py" imagefolder "$FMNIST" "$OUT/data/fmnist_folder" \
    --per-class "$PER_CLASS"
step train-224 "${SENSAI[@]}" train --model "$MODEL" --dataset imagefolder \
    --data-dir "$OUT/data/fmnist_folder" --image-size "$SIZE" --epochs 1 --device "$DEVICE" \
    --out "$OUT/models/${MODEL}_${SIZE}"
step decompose-224 "${SENSAI[@]}" decompose --model-dir "$OUT/models/${MODEL}_${SIZE}" --groups 2 \
    --policy keep --retrain-epochs 0 --features-per-class 10 --stats-per-class 10 \
    --device "$DEVICE" --no-ray --out "$OUT/models/${MODEL}_${SIZE}_g2"
bench_224 "$FIRST"

# --- 7: the other runtimes.  Past the deadline the remaining steps are skipped, so the table
# still comes.
for rt in $REST; do
    bench_flagship "$rt"
    bench_224 "$rt"
done

# --- 8: one table.
step report "$PY" "$REPO/deploy/gpu_check.py" report "$OUT"
cat "$OUT/gpu-check.md" 2>/dev/null
say "total $(( $(date +%s) - T0 )) s; failed steps: ${FAILED[*]:-none}"
(( ${#FAILED[@]} == 0 ))
