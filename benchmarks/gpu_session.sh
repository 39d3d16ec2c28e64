#!/usr/bin/env bash
# The CUDA checks of issue #12, prepared as one command for a lent GPU machine (the
# device tool gives a session 15 minutes and at most 600 s a command). Each step
# runs under its own time limit, taken from what is left of the budget, in the order
# of their value, so one call brings back whatever finished:
#
#   1. step time and parity, 1 GPU, compute shape: ours compiled (torch's AdamW and
#      the local-shard one) against the unsharded model compiled (the 1.03x goal),
#      torch's per-block compile and both eager runtimes; the step-1 losses of all
#      must agree (the report's loss check). Every step-time and profile run steps
#      AdamW fused, as torchtitan and HF Trainer do (--adamw fused);
#   2. the trainer in fp32 and bf16 (`traceable-hsdp train`, Inductor);
#   3. where the step goes (`profile_step.py`, CUDA activities);
#   4. step time, overhead shape;
#   5. cold and warm first-step compile time (`compile_time.py`, 4 layers).
#
# Run from the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/gpu_session.sh [BUDGET_SECONDS, default 540]
# It writes $OUT/gpu_session.log and $OUT/gpu_session.tar.gz (every report's .md,
# .json and .png). The library is installed into a folder of its own and every step
# runs outside the checkout, so the installed package is the one imported. Where
# torch lacks what the passes need from torch 2.13 (the GPU image holds torch 2.11),
# benchmarks/gpu_shim/ goes first on PYTHONPATH and the log says so; torch 2.11 is
# not a supported torch, which its figures must say where they are recorded
# (docs/benchmarks.md, "On GPUs").
#
# A dry run of the same steps on the CPU, with the smallest shapes, checks the
# script itself: DEVICE=cpu SMOKE=1 OUT=/tmp/x bash benchmarks/gpu_session.sh 900
set -u
: "${OUT:?set OUT to the folder for the results}"
BUDGET=${1:-540}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
PY=${PY:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT  # the installed library, the Inductor cache, the reports
RESULTS=$WORK/results
mkdir -p "$OUT" "$RESULTS"
LOG=$OUT/gpu_session.log
START=$SECONDS

say() { echo "[gpu_session $((SECONDS - START)) s] $*" | tee -a "$LOG"; }

# Runs "$@" from $WORK with at most $1 seconds, capped by what the budget has left
# (20 s kept for packing); skipped when under 30 s are left.
step() {
    local want=$1 name=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START) - 20))
    local limit=$((want < left ? want : left))
    if [ "$limit" -lt 30 ]; then
        say "SKIPPED $name: ${left} s left of the budget"
        return
    fi
    say "START $name (limit ${limit} s): $*"
    (cd "$WORK" && timeout "$limit" "$@") >>"$LOG" 2>&1
    say "END $name: exit $?"
}

say "device $DEVICE, smoke $SMOKE, budget $BUDGET s, repository $REPO"
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1

SITE=$WORK/site
"$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$REPO" \
    >>"$LOG" 2>&1 || { say "FAILED: pip install of the library"; exit 1; }
export PYTHONPATH=$SITE
if ! "$PY" -c "import torch._inductor.custom_graph_pass as c; c.get_custom_graph_passes" \
    2>/dev/null; then
    export PYTHONPATH=$REPO/benchmarks/gpu_shim:$SITE
    say "torch lacks get_custom_graph_passes: the shim is on (not a supported torch)"
fi
(cd "$WORK" && "$PY" -c "import torch, traceable_hsdp as th; print('torch', torch.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(), 'traceable_hsdp',
th.__file__)") 2>&1 | tee -a "$LOG"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_cache

B=$REPO/benchmarks
if [ "$SMOKE" = 1 ]; then
    SHAPE=(--smoke); ROUNDS=(); OVERHEAD=(--smoke); TRAIN=(--layers 1 --dim 32 --steps 3)
    PSHAPE=(--shape smoke); LAYERS=1
else
    SHAPE=(--shape compute); ROUNDS=(--rounds 6 --steps 5); OVERHEAD=(--shape overhead)
    TRAIN=(--steps 8); PSHAPE=(--shape compute); LAYERS=4
fi
FOUR=ours_compiled,ours_compiled_local_adamw,unsharded_compiled_1rank,torch_block_compiled

step 240 "step time, 1 rank, compute shape" \
    "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${SHAPE[@]}" "${ROUNDS[@]}" \
    --variants "$FOUR,ours_eager,torch_eager" --adamw fused --out "$RESULTS" --no-progress
for mp in none bf16; do
    step 90 "trainer, $mp" "$PY" -m torch.distributed.run --nproc_per_node 1 \
        -m traceable_hsdp.demo.cli train --device "$DEVICE" --mixed-precision "$mp" "${TRAIN[@]}"
done
step 120 "profile, compute shape" "$PY" "$B/profile_step.py" --device "$DEVICE" --world 1 \
    "${PSHAPE[@]}" --variants ours_compiled,unsharded_compiled_1rank --adamw fused \
    --out "$RESULTS"
step 200 "step time, 1 rank, overhead shape" \
    "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${OVERHEAD[@]}" "${ROUNDS[@]}" \
    --variants "$FOUR" --adamw fused --out "$RESULTS" --no-progress
step 240 "compile time, $LAYERS layers" "$PY" "$B/compile_time.py" --device "$DEVICE" \
    --layers "$LAYERS" --variants plain_whole,torch_block_compiled,ours_compiled --out "$RESULTS"

tar -czf "$OUT/gpu_session.tar.gz" -C "$RESULTS" . && say "packed: $(ls "$RESULTS" | tr '\n' ' ')"
say "done"
