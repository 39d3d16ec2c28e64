#!/usr/bin/env bash
# Every CUDA check of docs/benchmarks.md as one command for a GPU machine that is lent
# for a short time (minutes, at most 600 s a command). Each step runs under its own
# time limit, taken from what is left of the budget, in the order of their value, so
# one call brings back whatever finished:
#
#   1. step time and the loss check, 1 GPU, compute shape: ours compiled (torch's AdamW
#      and the local-shard one) against the unsharded model compiled, torch's
#      per-block compile and both eager runtimes; the step-1 losses of all must agree
#      (the report's loss check). Every step-time and profile run steps AdamW fused, as
#      torchtitan and HF Trainer do (--adamw fused);
#   2. the trainer in fp32 and bf16 (`traceable-hsdp train`, Inductor);
#   3. where the step goes (`profile_step.py`, CUDA activities);
#   4. step time, overhead shape;
#   5. cold and warm first-step compile time (`compile_time.py`, 4 layers).
#
# traceable_hsdp runs on torch 2.13, 2.14 and 2.15 and refuses any other torch. On
# another torch (a machine's image may hold only an older one) the script says so in
# the log, skips every step that runs traceable_hsdp, and runs torch's own baselines
# alone: the step time of torch's fully_shard (eager and per-block compiled) and of
# the unsharded model compiled (steps 1 and 4, where the benchmark harness can run:
# it needs torch._inductor.custom_graph_pass.get_custom_graph_passes, from torch
# 2.13 on), and their compile time (step 5). Each skipped step is logged with why.
# OURS=0 takes that path on any torch (to check it on a supported one).
#
# Run from the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/gpu_session.sh [BUDGET_SECONDS, default 540]
# It writes $OUT/gpu_session.log and $OUT/gpu_session.tar.gz (every report's .md,
# .json and .png). The library is installed into a folder of its own and every step
# runs outside the checkout, so the installed package is the one imported.
#
# A dry run of the same steps on the CPU, with the smallest shapes, checks the
# script itself: DEVICE=cpu SMOKE=1 OUT=/tmp/x bash benchmarks/gpu_session.sh 900
set -u
: "${OUT:?set OUT to the folder for the results}"
BUDGET=${1:-540}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
PY=${PY:-python3}
OURS=${OURS:-1}
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

# A step that runs traceable_hsdp: skipped, with the reason, on a torch it refuses.
ours_step() {
    if [ "$OURS" = 1 ]; then
        step "$@"
    else
        say "SKIPPED $2: runs traceable_hsdp ($WHY; it needs torch 2.13-2.15)"
    fi
}

say "device $DEVICE, smoke $SMOKE, budget $BUDGET s, repository $REPO"
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1

SITE=$WORK/site
"$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$REPO" \
    >>"$LOG" 2>&1 || { say "FAILED: pip install of the library"; exit 1; }
export PYTHONPATH=$SITE
(cd "$WORK" && "$PY" -c "import torch, traceable_hsdp as th; print('torch', torch.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(), 'traceable_hsdp',
th.__file__)") 2>&1 | tee -a "$LOG"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_cache

# Whether this torch runs traceable_hsdp: one it was checked on (CHECKED_ON), on which
# every torch internal it relies on resolves (what fully_shard checks first).
WHY="OURS=0 given"
if [ "$OURS" = 1 ]; then
    WHY=$(cd "$WORK" && "$PY" -c "
import torch
from traceable_hsdp._torch_internals import CHECKED_ON, install
minor = lambda v: tuple(v.split('+')[0].split('.')[:2])
if minor(torch.__version__) not in {minor(v) for v in CHECKED_ON}:
    print(f'torch {torch.__version__} is not one of {\", \".join(CHECKED_ON)}')
else:
    try:
        install()
        print('OK')
    except Exception as e:
        msg = ' '.join(str(e).split())
        print(f'{type(e).__name__}: {msg}')
" 2>>"$LOG" | tail -n 1)
    if [ "$WHY" = OK ]; then
        say "traceable_hsdp runs on this torch: every step runs"
    else
        OURS=0
        WHY=${WHY:-the check of this torch failed, its error is in the log}
    fi
fi
HARNESS=1
if [ "$OURS" = 0 ]; then
    if [ "$WHY" = "OURS=0 given" ]; then
        say "OURS=0: every step of traceable_hsdp is skipped; only torch's own baselines run"
    else
        say "NOT A SUPPORTED TORCH for traceable_hsdp ($WHY): it needs torch 2.13-2.15;" \
            "only torch's own baselines run, and every step of ours is skipped"
    fi
    if ! "$PY" -c "from torch._inductor.custom_graph_pass import get_custom_graph_passes" \
        2>/dev/null; then
        HARNESS=0
        say "the step-time harness needs get_custom_graph_passes of" \
            "torch._inductor.custom_graph_pass (torch 2.13 on), which this torch lacks"
    fi
fi

# A step-time run of torch's variants alone, on an unsupported torch.
torch_step() {
    if [ "$HARNESS" = 1 ]; then
        step "$@"
    else
        say "SKIPPED $2: the step-time harness cannot run on this torch"
    fi
}

B=$REPO/benchmarks
if [ "$SMOKE" = 1 ]; then
    SHAPE=(--smoke); ROUNDS=(); OVERHEAD=(--smoke); TRAIN=(--layers 1 --dim 32 --steps 3)
    PSHAPE=(--shape smoke); LAYERS=1
else
    SHAPE=(--shape compute); ROUNDS=(--rounds 6 --steps 5); OVERHEAD=(--shape overhead)
    TRAIN=(--steps 8); PSHAPE=(--shape compute); LAYERS=4
fi
FOUR=ours_compiled,ours_compiled_local_adamw,unsharded_compiled_1rank,torch_block_compiled
TORCH_ONLY=unsharded_compiled_1rank,torch_block_compiled,torch_eager

if [ "$OURS" = 1 ]; then
    step 240 "step time, 1 rank, compute shape" \
        "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${SHAPE[@]}" "${ROUNDS[@]}" \
        --variants "$FOUR,ours_eager,torch_eager" --adamw fused --out "$RESULTS" --no-progress
else
    torch_step 180 "step time, 1 rank, compute shape, torch's variants" \
        "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${SHAPE[@]}" "${ROUNDS[@]}" \
        --variants "$TORCH_ONLY" --adamw fused --out "$RESULTS" --no-progress
fi
for mp in none bf16; do
    ours_step 90 "trainer, $mp" "$PY" -m torch.distributed.run --nproc_per_node 1 \
        -m traceable_hsdp.demo.cli train --device "$DEVICE" --mixed-precision "$mp" "${TRAIN[@]}"
done
ours_step 120 "profile, compute shape" "$PY" "$B/profile_step.py" --device "$DEVICE" \
    --world 1 "${PSHAPE[@]}" --variants ours_compiled,unsharded_compiled_1rank \
    --adamw fused --out "$RESULTS"
if [ "$OURS" = 1 ]; then
    step 200 "step time, 1 rank, overhead shape" \
        "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${OVERHEAD[@]}" "${ROUNDS[@]}" \
        --variants "$FOUR" --adamw fused --out "$RESULTS" --no-progress
    CT=plain_whole,torch_block_compiled,ours_compiled
else
    torch_step 150 "step time, 1 rank, overhead shape, torch's variants" \
        "$PY" "$B/step_time.py" --device "$DEVICE" --world 1 "${OVERHEAD[@]}" "${ROUNDS[@]}" \
        --variants "$TORCH_ONLY" --adamw fused --out "$RESULTS" --no-progress
    CT=plain_whole,torch_block_compiled
fi
step 240 "compile time, $LAYERS layers, $CT" "$PY" "$B/compile_time.py" --device "$DEVICE" \
    --layers "$LAYERS" --variants "$CT" --out "$RESULTS"

tar -czf "$OUT/gpu_session.tar.gz" -C "$RESULTS" . && say "packed: $(ls "$RESULTS" | tr '\n' ' ')"
say "done"
