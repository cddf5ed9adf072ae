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
# Steps, most wanted first, each timed in OUT/gpu-check.log.  The table comes by
# $SENSAI_GPU_CHECK_DEADLINE_S seconds (default 480, so within the machine's lease): every step
# runs under `timeout` with a cap of its own (so a slow or stuck one gives its time to the
# ones after it), shortened to what is left before the report's turn; no step starts in the
# last stretch before it (too short to finish anything), and a step skipped, cut or failed is a
# line of the table.  --tiny multiplies the caps by ten (a 2-core VM is no GPU);
# $SENSAI_GPU_CHECK_CAP_PCT scales them (percent) either way.
#   1. train VGG-16-bn on Fashion-MNIST (3 epochs) on the GPU, each step replayed from a
#      captured CUDA graph (the default), then again with eager steps (--set capture=false);
#   2. decompose it at G=2 with the defaults, retraining on the GPU (in process: no Ray) with
#      captured steps, then with eager ones on a fifth of the images (the speed, not the
#      accuracy, is the question there); each offline step's wall seconds go to its folder;
#   3. serving throughput: `sensai bench-load --sweep` of the decomposed artifact, KServe v2
#      tensors from four client processes on four cores of their own (the server on the
#      others), closed loops of 1 to 256 requests in flight, three times:
#      a. OUT/load: the automatic count of gateway processes, the GPU waited for by spinning
#         (the default), the original behind the same gateway beside it, then an overload;
#      b. OUT/load-sleep: the same with SENSAI_GPU_WAIT=sleep, the artifact alone, no
#         overload: what a spinning wait costs the host's cores and buys in latency;
#      c. OUT/load-n1: one gateway process over the same device process (--backend processes,
#         SENSAI_GATEWAY_REPLICAS=1), the artifact alone at 1, 16 and 64 in flight, no
#         overload: the ceiling the automatic count lifts;
#      each level records its answers/s, latency, rows per batch of each subnet, the server's
#      CPU per answer and the GPU's busy share (nvidia-smi); the machine's cores go to the log,
#      the GPU's busy share over the whole step (nvidia-smi, every 0.5 s) to
#      OUT/<sweep>/gpu-util.csv;
#   4. the sensAI paper's regime: decompose it into subnets 20x smaller (--set shrink=20) at G=2
#      and at G=10, each capped by the speed step 2 measured (its stages, its retraining's
#      seconds per image times the images they retrain, 1.5x and 30 s more; else
#      $SENSAI_GPU_CHECK_OFFLINE_S seconds, default 150);
#   5. bench single device, model parallel and class parallel on CUDA graphs, in process and
#      through the real gateway over HTTP (PNG upload, KServe v2 tensor);
#   6. the GPU tests (tests/test_graphs.py; tests/test_train_step.py's captured step on CUDA);
#   7. the same latency comparison on a latency-only VGG-16-bn artifact at 224x224
#      (1 training epoch on a few hundred images, --policy keep, no retraining);
#   8. steps 5 and 7 on eager torch;
#   9. one table: OUT/gpu-check.md (bench.json / bench.md of every run under OUT/<run>/, each
#      sweep's best level and a row per level of every sweep beside its own OUT/<sweep>/load.md,
#      and the offline work: each training's and decomposition's time, images/s and accuracy
#      beside the original's); a step skipped, cut or failed is a line of it, so the table comes
#      whatever ran.
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
# The table comes by DEADLINE_S.  Before it: the report's own time, and the grace a cut step
# gets between timeout's TERM and its KILL.  Every other step ends by END_S; none starts after
# START_BY_S, since what is left then is too short to finish one (it is skipped, and the table
# says so).
DEADLINE_S=${SENSAI_GPU_CHECK_DEADLINE_S:-480}
REPORT_S=15 KILL_AFTER_S=10 MIN_STEP_S=30
END_S=$(( DEADLINE_S - REPORT_S - KILL_AFTER_S ))
START_BY_S=$(( END_S - MIN_STEP_S ))
# Each step's cap is set for the GPU machine; a 2-core VM is no GPU, so --tiny gives ten times
# as much (the deadline still holds).
CAP_PCT=${SENSAI_GPU_CHECK_CAP_PCT:-$(( TINY ? 1000 : 100 ))}

say() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# `timeout` runs each step in a process group of its own, out of reach of a terminal's Ctrl-C: a
# signal to this script is passed on to the running step (and the GPU sampler of a sweep), and
# the check stops there.
STEP_PID= SMI_PID=
stop() {
    [[ -n $SMI_PID ]] && kill "$SMI_PID" 2>/dev/null
    [[ -n $STEP_PID ]] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID"
    say "stopped by a signal; failed steps: ${FAILED[*]:-none}"
    exit 130
}
trap stop INT TERM

# step NAME CAP CMD...: run CMD under `timeout`, logged and timed; a failed, cut or skipped step
# is reported at the end and the rest go on.  CAP: the step's own limit in seconds, scaled by
# CAP_PCT and cut to what is left before END_S.  The report keeps its cap as it is (it only
# guards against a hung report) and is never skipped: it is what the deadline is for.
step() {
    local name=$1 cap=$2; shift 2
    local t=$(date +%s)
    if [[ $name != report ]]; then
        cap=$(( cap * CAP_PCT / 100 ))
        (( cap < 1 )) && cap=1
        if (( t - T0 > START_BY_S )); then
            say "$name: SKIPPED (past the ${START_BY_S} s deadline for a step to start; the table is due at ${DEADLINE_S} s)"
            FAILED+=("$name")
            return 1
        fi
        (( cap > END_S - (t - T0) )) && cap=$(( END_S - (t - T0) ))
    fi
    say "$name (cap ${cap} s): $*"
    timeout -k "$KILL_AFTER_S" "$cap" "$@" >>"$LOG" 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID"
    local rc=$?
    STEP_PID=
    if (( rc == 0 )); then
        say "$name: done in $(( $(date +%s) - t )) s"
        return 0
    elif (( rc == 124 || rc == 137 )); then
        say "$name: FAILED after $(( $(date +%s) - t )) s (cut at its ${cap} s cap; see $LOG)"
    else
        say "$name: FAILED after $(( $(date +%s) - t )) s (status $rc; see $LOG)"
    fi
    FAILED+=("$name")
    return 1
}

# --- Python: this one if it has everything, else the bundle's wheels beside it.
PY=${PYTHON:-python3}
[[ -x $REPO/.venv/bin/python ]] && PY=$REPO/.venv/bin/python
# What the steps import, then what the log says of torch: one interpreter's start for both.
NEEDED="import fastapi, uvicorn, pydantic_settings, multipart, torch_pruning, pytest, sensai.serving.gateway.app
import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
if ! TORCH=$(timeout 120 "$PY" -c "$NEEDED" 2>/dev/null); then
    [[ -d $BUNDLE/wheels ]] || { say "no $BUNDLE/wheels: run 'deploy/gpu-check.sh --fetch' on a machine with network"; exit 2; }
    # Into a folder on PYTHONPATH rather than a venv: the machine's torch may live where a
    # venv does not look (a distribution's dist-packages, a user site).
    SITE=$OUT/site
    step wheels 180 "$PY" -m pip install -q --no-index --find-links "$BUNDLE/wheels" --target "$SITE" \
        $(grep -v -e '^#' -e '^torch-pruning' -e '^setuptools' "$REPO/deploy/gpu-requirements.txt") || exit 2
    # Its own dependencies (torch, numpy) are the machine's.
    step torch-pruning 60 "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE/wheels" \
        --target "$SITE" torch-pruning || exit 2
    # setuptools only builds sensai: it stays off the path the runs use (torch pins its own).
    step setuptools 60 "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE/wheels" \
        --target "$OUT/build-tools" setuptools || exit 2
    step sensai 120 env PYTHONPATH="$OUT/build-tools" "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation --target "$SITE" "$REPO" || exit 2
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    TORCH=$(timeout 120 "$PY" -c "$NEEDED" 2>>"$LOG") || { say "the environment still lacks a package (see $LOG)"; exit 2; }
fi
SENSAI=("$PY" -m sensai)
echo "$TORCH" | tee -a "$LOG"

FMNIST=/usr/share/datasets/fashion-mnist
[[ -f $FMNIST/train-images-idx3-ubyte.gz ]] || FMNIST=$BUNDLE/fashion-mnist

if (( TINY )); then
    DEVICE=cpu RUNTIMES=torch MODEL=fmnist_cnn SIZE=32
    TRAIN=(--epochs 1 --set train_limit=600)
    DECOMPOSE=(--retrain-epochs 1 --samples-per-subnet 256 --set features_per_class=10
               --set stats_per_class=20 --set eval_limit=200)
    EAGER_SAMPLES=(--samples-per-subnet 64) CAP_SAMPLES=(--samples-per-subnet 256)
    BENCH=(--images 8 --set warmup=2 --set rounds=1 --concurrency 2 --requests 8)
    TINY_LOAD=(--levels 1 2 --set level_seconds=1 --set warmup_seconds=1 --images 8)
    LOAD=(--configs class-parallel single "${TINY_LOAD[@]}" --set overload_seconds=1)
    LOAD_SLEEP=(--configs class-parallel "${TINY_LOAD[@]}" --set overload_seconds=0)
    LOAD_N1=("${LOAD_SLEEP[@]}")
    PER_CLASS=6
else
    DEVICE=cuda RUNTIMES="cuda-graph torch" MODEL=vgg16_bn SIZE=224
    TRAIN=(--epochs 3)
    DECOMPOSE=()
    EAGER_SAMPLES=(--samples-per-subnet 60000) CAP_SAMPLES=()
    BENCH=(--images 200)
    # Four client processes on four cores of their own, the server on the others.  Batching
    # against none was measured on an H100 once (BENCHMARKS.md), so the sweeps leave it out;
    # at 256 in flight a subnet's batches have room to fill (up to 128 rows on a GPU).
    CLIENTS=(--set clients=4 --set client_cores=4)
    LOAD=(--configs class-parallel single --levels 1 16 64 256
          --set level_seconds=2 --set overload_seconds=4 "${CLIENTS[@]}")
    # The other way to wait for the GPU, on the artifact alone: its overload says nothing the
    # first sweep's does not.
    LOAD_SLEEP=(--configs class-parallel --levels 1 16 64 256 --set level_seconds=2
                --set overload_seconds=0 "${CLIENTS[@]}")
    # One gateway process: its ceiling shows by 64 in flight, so no 256 and no overload.
    LOAD_N1=(--configs class-parallel --levels 1 16 64 --set level_seconds=2
             --set warmup_seconds=2 --set overload_seconds=0 "${CLIENTS[@]}")
    PER_CLASS=30
fi
STRATS=(--strategies single model-parallel class-parallel)

# Each step's cap (seconds on the GPU machine): room for a run slower than usual, not for one
# that has stalled, so that the steps after it still get their turn; a step whose artifact the
# rest need (train, decompose) gets the widest margin.
CAP_TRAIN=90 CAP_DECOMPOSE=210 CAP_DECOMPOSE_EAGER=90 CAP_OFFLINE=${SENSAI_GPU_CHECK_OFFLINE_S:-150}
CAP_LOAD=190 CAP_LOAD_SLEEP=75 CAP_LOAD_N1=60
CAP_BENCH=120 CAP_GPU_TESTS=120 CAP_IMAGEFOLDER=60 CAP_TRAIN_224=90 CAP_DECOMPOSE_224=120
CAP_REPORT=120

# offline NAME DIR CAP CMD...: a step whose output folder is DIR; its wall seconds go to
# DIR/wall_s for the table (beside what the command itself timed inside).
offline() {
    local name=$1 dir=$2 cap=$3; shift 3
    local t=$(date +%s)
    step "$name" "$cap" "$@" || return 1
    [[ -d $dir ]] && echo $(( $(date +%s) - t )) >"$dir/wall_s"
    return 0
}

# --- 1-2: the flagship, trained and decomposed on the device: captured steps (the default),
# then eager ones.
M=$OUT/models
offline train "$M/$MODEL" "$CAP_TRAIN" "${SENSAI[@]}" train --model "$MODEL" --data-dir "$FMNIST" \
    "${TRAIN[@]}" --device "$DEVICE" --out "$M/$MODEL"
offline train-eager "$M/${MODEL}_eager" "$CAP_TRAIN" "${SENSAI[@]}" train --model "$MODEL" \
    --data-dir "$FMNIST" "${TRAIN[@]}" --device "$DEVICE" --set capture=false \
    --out "$M/${MODEL}_eager"
offline decompose "$M/${MODEL}_g2" "$CAP_DECOMPOSE" "${SENSAI[@]}" decompose \
    --model-dir "$M/$MODEL" --groups 2 --device "$DEVICE" --no-ray "${DECOMPOSE[@]}" \
    --out "$M/${MODEL}_g2"
offline decompose-eager "$M/${MODEL}_g2_eager" "$CAP_DECOMPOSE_EAGER" "${SENSAI[@]}" decompose \
    --model-dir "$M/$MODEL" --groups 2 --device "$DEVICE" --no-ray "${DECOMPOSE[@]}" \
    "${EAGER_SAMPLES[@]}" --set capture=false --out "$M/${MODEL}_g2_eager"

# --- 3: serving throughput (the gateway picks the device itself: --device auto), with the
# automatic count of gateway processes (1 under 4 cores, else half the cores, at most 8), the
# GPU waited for by spinning then by sleeping, then with one gateway process over the same
# device process (the processes backend: the local one would run the subnets in its threads).
# load_sweep NAME DIR CAP ARGS...: one sweep into DIR, the GPU's utilisation sampled meanwhile.
say "cores: $(nproc) usable (nproc), $(nproc --all) in all"
load_sweep() {
    local name=$1 dir=$2 cap=$3; shift 3
    mkdir -p "$dir"
    if (( $(date +%s) - T0 <= START_BY_S )) && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 \
            >"$dir/gpu-util.csv" 2>>"$LOG" &
        SMI_PID=$!
    fi
    step "$name" "$cap" "${SENSAI[@]}" bench-load "$OUT/models/${MODEL}_g2" --out "$dir" --sweep \
        --transport http-v2 "$@"
    local rc=$?
    if [[ -n $SMI_PID ]]; then
        kill "$SMI_PID" 2>/dev/null
        wait "$SMI_PID" 2>/dev/null
        SMI_PID=
    fi
    return $rc
}
load_sweep load-sweep "$OUT/load" "$CAP_LOAD" "${LOAD[@]}"
load_sweep load-sweep-sleep "$OUT/load-sleep" "$CAP_LOAD_SLEEP" "${LOAD_SLEEP[@]}" \
    --env SENSAI_GPU_WAIT=sleep
load_sweep load-sweep-n1 "$OUT/load-n1" "$CAP_LOAD_N1" "${LOAD_N1[@]}" \
    --backend processes --env SENSAI_GATEWAY_REPLICAS=1

# --- 4: subnets 20x smaller, at G=2 and G=10, each capped by the speed step 2 measured.
X20_GROUPS=(2 10)
mapfile -t X20_CAPS < <("$PY" "$REPO/deploy/gpu_check.py" cap "$M/${MODEL}_g2/manifest.json" \
    --groups "${X20_GROUPS[@]}" --default "$CAP_OFFLINE" "${CAP_SAMPLES[@]}" 2>>"$LOG")
for i in "${!X20_GROUPS[@]}"; do
    G=${X20_GROUPS[$i]} cap=${X20_CAPS[$i]:-$CAP_OFFLINE}
    offline "decompose-x20-g$G" "$M/${MODEL}_g${G}_x20" "$cap" "${SENSAI[@]}" decompose \
        --model-dir "$M/$MODEL" --groups "$G" --set shrink=20 --device "$DEVICE" --no-ray \
        "${DECOMPOSE[@]}" --out "$M/${MODEL}_g${G}_x20"
done

# bench_flagship RUNTIME, bench_224 RUNTIME: the latency comparison, in process and through the
# real gateway.
bench_flagship() {
    step "bench-fmnist-$1" "$CAP_BENCH" "${SENSAI[@]}" bench "$OUT/models/${MODEL}_g2" \
        --device "$DEVICE" --runtime "$1" "${STRATS[@]}" --transports inprocess http http-v2 \
        "${BENCH[@]}" --out "$OUT/fmnist_$1"
}
bench_224() {
    step "bench-${SIZE}-$1" "$CAP_BENCH" "${SENSAI[@]}" bench "$OUT/models/${MODEL}_${SIZE}_g2" \
        --device "$DEVICE" --runtime "$1" "${STRATS[@]}" --transports inprocess http-v2 \
        "${BENCH[@]}" --out "$OUT/${SIZE}_$1"
}
FIRST=${RUNTIMES%% *} REST=${RUNTIMES#"$FIRST"}

# --- 5-6: the default runtime (graphs on a GPU), then the tests that need a GPU (they skip on
# a CPU).
bench_flagship "$FIRST"
(( TINY )) || step gpu-tests "$CAP_GPU_TESTS" env SENSAI_FMNIST_DIR="$FMNIST" "$PY" -m pytest -q \
    --import-mode=importlib -p no:cacheprovider "$REPO/tests/test_graphs.py" \
    "$REPO/tests/test_train_step.py::test_the_captured_step_trains_as_the_eager_step_does_a_short_last_batch_included"

# --- 7: the latency-only artifact at 224x224 (compute rather than launches).
step imagefolder "$CAP_IMAGEFOLDER" "$PY" "$REPO/deploy/gpu_check.py" imagefolder "$FMNIST" \
    "$OUT/data/fmnist_folder" --per-class "$PER_CLASS"
step train-224 "$CAP_TRAIN_224" "${SENSAI[@]}" train --model "$MODEL" --dataset imagefolder \
    --data-dir "$OUT/data/fmnist_folder" --image-size "$SIZE" --epochs 1 --device "$DEVICE" \
    --out "$OUT/models/${MODEL}_${SIZE}"
step decompose-224 "$CAP_DECOMPOSE_224" "${SENSAI[@]}" decompose \
    --model-dir "$OUT/models/${MODEL}_${SIZE}" --groups 2 --policy keep --retrain-epochs 0 \
    --set features_per_class=10 --set stats_per_class=10 --device "$DEVICE" --no-ray \
    --out "$OUT/models/${MODEL}_${SIZE}_g2"
bench_224 "$FIRST"

# --- 8: the other runtimes.  Past the deadline the remaining steps are skipped, so the table
# still comes.
for rt in $REST; do
    bench_flagship "$rt"
    bench_224 "$rt"
done

# --- 9: one table.
step report "$CAP_REPORT" "$PY" "$REPO/deploy/gpu_check.py" report "$OUT"
cat "$OUT/gpu-check.md" 2>/dev/null
say "total $(( $(date +%s) - T0 )) s; failed steps: ${FAILED[*]:-none}"
(( ${#FAILED[@]} == 0 ))
