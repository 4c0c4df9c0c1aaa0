#!/usr/bin/env bash
# The GPU checks of #33-#35, prepared for a session that is lent a GPU (15 minutes of device
# time, machine start included; one command may run 10 minutes). Three parts, one call each
# (the third needs no GPU, only the machine's 16-core CPU):
#
#   bash benchmarks/gpu_session.sh engine    # ~7 min: build the native parts; the tests that use
#                                            # CUDA where it is (Triton kernels vs the reference, row
#                                            # invariance, graph steps = eager, the drafter's graph
#                                            # depths = its eager steps); benchmarks/gpu.py
#   bash benchmarks/gpu_session.sh drafter   # ~4 min: a drafter warm-started on the GPU, then
#                                            # benchmarks/drafter.py's rollout (drafter alone,
#                                            # hybrid, suffix default vs plain, identical shares)
#   bash benchmarks/gpu_session.sh host      # the machine's 16-core CPU, no GPU: #34's
#                                            # benchmarks/spec_host.py (default vs plain on `small`)
#
# Logs and JSON lines go to $OUT (the device tool's folder that comes back; default
# /tmp/gpu_session). Every step has its own timeout, so a hang costs that step only.
# A smoke test of the script on a CPU: DEVICE=cpu QUICK=1 bash benchmarks/gpu_session.sh drafter
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
M=/tmp/tailrl-standins/0.5b
D=/tmp/drafter-0.5b
if [ -n "${QUICK:-}" ]; then    # tiny sizes: checks the script, measures nothing
    GPU_ARGS="--quick --no-hf" TRAIN_ARGS="'--prompts', '2', '--steps', '2', '--max-tokens', '32'"
    ROLLOUT_ARGS="--prompts 2 --n 2 --max-tokens 16" M=${M}-quick D=${D}-quick
else
    GPU_ARGS="" TRAIN_ARGS="'--prompts', '64', '--steps', '300'" ROLLOUT_ARGS="--max-tokens 512"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
    tail -n 3 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.is_available())" >>"$OUT/gpu.txt" 2>&1
case "${1:-}" in
engine)
    step build 120 $PY setup.py build_ext --inplace
    if $PY -c "import pytest" 2>/dev/null; then
        step gpu_tests 150 $PY -m pytest -q tests/kernels/test_triton.py tests/drafter/test_drafter_graphs.py
    else
        echo "gpu_tests: skipped (no pytest on this machine)" | tee -a "$OUT/summary.txt"
    fi
    step gpu 400 $PY benchmarks/gpu.py --device "$DEVICE" --standin-dir /tmp/tailrl-standins $GPU_ARGS
    ;;
drafter)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 120 $PY setup.py build_ext --inplace
    [ -d "$M" ] || step standin 120 $PY -c "from tailrl.cli import main; main(['make-model', '--standin', '0.5b', '--out', '$M'])"
    step train_drafter 120 $PY -c "from tailrl.cli import main; main(['train-drafter', '--model', '$M', '--out', '$D', \
'--device', '$DEVICE', $TRAIN_ARGS])"
    step drafter 330 $PY benchmarks/drafter.py --device "$DEVICE" --model "$M" --drafter "$D" --rounds 1 $ROLLOUT_ARGS
    ;;
host)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 120 $PY setup.py build_ext --inplace
    step spec_host 500 $PY benchmarks/spec_host.py --rounds 2
    ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh engine|drafter|host" >&2
    exit 2
    ;;
esac
