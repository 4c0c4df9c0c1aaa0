#!/usr/bin/env bash
# The GPU checks of #33-#35, prepared for a session that is lent a GPU (15 minutes of device
# time, machine start included; one command may run 10 minutes). One call each:
#
#   bash benchmarks/gpu_session.sh all       # <= 10 min: engine, then (if benchmarks/gpu.py's
#                                            # rollouts ran) drafter
#   bash benchmarks/gpu_session.sh engine    # build the native parts; with MEASURE_TILES=1 the
#                                            # matmul's tiles (benchmarks/matmul_tiles.py, used for
#                                            # the rest of the run); with MEASURE_ATTENTION=1 the
#                                            # attention's keys per lane step (benchmarks/attention.py);
#                                            # benchmarks/gpu.py (Hugging Face's rollout, GRPO steps
#                                            # and float64 GPU = CPU only with FULL=1: measured at
#                                            # stop 45); the tests
#                                            # that use CUDA where it is (Triton kernels vs the
#                                            # reference, row invariance, graph steps = eager, the
#                                            # drafter's graph depths = its eager steps)
#                                            # (the kernels' on 8 xdist workers, then the engines')
#   bash benchmarks/gpu_session.sh extras    # ~2.5 min: Qwen3.5's hybrid (benchmarks/deltanet.py), gpt-oss's
#                                            # MXFP4 load (benchmarks/mxfp4_load.py), a graph's launch
#                                            # by its kernels (benchmarks/graph_launch.py), sliding
#                                            # windows (benchmarks/sliding_window.py)
#   bash benchmarks/gpu_session.sh drafter   # a drafter warm-started on the GPU, then
#                                            # benchmarks/drafter.py's rollout (drafter alone,
#                                            # hybrid, suffix default vs plain, identical shares);
#                                            # benchmarks/drafter_step.py (a chain depth on the
#                                            # engine's kernels vs the padded step) and
#                                            # benchmarks/drafter_call.py (whole calls);
#                                            # benchmarks/drafter_vocab.py (a depth's cost with a
#                                            # draft vocabulary)
#   bash benchmarks/gpu_session.sh grpo      # after `all` on the same machine (or it makes the
#                                            # stand-in and drafter again): #35's 20-step GRPO run
#                                            # (benchmarks/drafter_online.py: plain, suffix, frozen
#                                            # and online drafter on the 0.5b stand-in, each trainer's
#                                            # engine at 0.12 of the GPU: four trainers, each
#                                            # with its policy, AdamW and scorer, share it;
#                                            # GRPO_RUNS=plain,suffix,frozen,online,online_side
#                                            # adds the spot trainer on a side CUDA stream)
#   bash benchmarks/gpu_session.sh profile   # benchmarks/step_profile.py: the plain rollout's steps
#                                            # with and without steps launched ahead (A B B A),
#                                            # the operations that wait for the GPU, profiler tables
#   bash benchmarks/gpu_session.sh host      # the machine's 16-core CPU, no GPU: #34's
#                                            # benchmarks/spec_host.py (default vs plain on `small`)
#
# Logs and JSON lines go to $OUT (the device tool's folder that comes back; default
# /tmp/gpu_session). Every step has its own timeout, so a hang costs that step only.
# A smoke test of the script on a CPU: DEVICE=cpu QUICK=1 bash benchmarks/gpu_session.sh all
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
    # the drafter's warm start: up to 1,000 steps within 30 s of training (300 steps, the previous
    # session's, gave a drafter that accepted 1.87 tokens a verify against the suffix drafts' ~4)
    # Hugging Face's rollout, 2 GRPO steps and small's float64 GPU-vs-CPU tokens only with FULL=1
    # (measured at stop 45: 37.1 s, 1.02 s a step, 64 of 64 equal): ~80 s of a session's time
    GPU_ARGS="$([ -n "${FULL:-}" ] && echo --train-steps 2 || echo --no-hf --train-steps 0 --compare-prompts 0)" TRAIN_ARGS="'--prompts', '64', '--steps', '1000', '--max-seconds', '30'"
    ROLLOUT_ARGS="--max-tokens 512"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
    tail -n 3 "$OUT/$name.log"
    return $rc
}

engine() {
    step build ${BUILD_LIMIT:-60} $PY setup.py build_ext --inplace
    # the matmul's tiles measured here (MEASURE_TILES=1; 90 s): matmul.py's default is the best of
    # six measured on an H100, so a session spends its device time on the rest by default
    if [ "$DEVICE" = cuda ] && [ -n "${MEASURE_TILES:-}" ] && [ -z "${TAILRL_MATMUL_TILES:-}" ]; then
        step tiles ${TILES_LIMIT:-90} $PY benchmarks/matmul_tiles.py --out /tmp/tailrl-tiles
        if [ -s /tmp/tailrl-tiles ]; then
            export TAILRL_MATMUL_TILES=$(cat /tmp/tailrl-tiles)
            echo "TAILRL_MATMUL_TILES=$TAILRL_MATMUL_TILES" | tee -a "$OUT/summary.txt"
        fi
    fi
    # dots and keys per lane step (43 s for 2 x 2; stop 45: 32 keys, groups of 4 best; stop 46 on an
    # H200: tensor cores 1.3-3.8x faster, 32 keys still best from 64 rows)
    # (ATTENTION_ARGS: e.g. --keys 32,64; both dots by default)
    [ "$DEVICE" = cuda ] && [ -n "${MEASURE_ATTENTION:-}" ] && step attention ${ATTENTION_LIMIT:-60} $PY benchmarks/attention.py \
        ${ATTENTION_ARGS:-}
    step gpu ${GPU_LIMIT:-280} $PY benchmarks/gpu.py --device "$DEVICE" --standin-dir /tmp/tailrl-standins $GPU_ARGS \
        ${GPU_VARIANTS:+--variants $GPU_VARIANTS} --partial-json "$OUT/gpu_partial.json"
    # every GPU test passed at stop 68 but one (a tiny model's 8-wide heads on tensor cores: fixed
    # since, not yet rerun on a GPU); new since: Qwen3.5's graph steps in test_triton_models.py
    # the kernels' tests (each engine in a small pool of its own) on 8 xdist workers: mostly Triton's compiles,
    # which the host's 16 cores do side by side; then the engines' tests one at a time (some size their pool
    # from the GPU's free memory)
    if $PY -c "import pytest, xdist, pytest_timeout" 2>/dev/null; then
        step kernel_tests ${KTEST_LIMIT:-150} $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" \
            -n ${TEST_WORKERS:-8} --timeout 120 -rf \
            tests/kernels/test_triton.py tests/kernels/test_triton_models.py tests/kernels/test_delta.py \
            tests/kernels/test_triton_sampler.py \
            tests/kernels/test_stock.py tests/kernels/test_launches.py
        step gpu_tests ${TEST_LIMIT:-200} $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" \
            --timeout 120 -rf \
            tests/drafter/test_drafter_graphs.py tests/drafter/test_drafter_ahead.py tests/drafter/test_side_stream.py \
            tests/engine/test_ahead.py tests/engine/test_ahead_drafts.py tests/rl/test_device.py \
            tests/engine/test_engine_device.py \
            tests/engine/test_logits_process.py::test_on_a_gpu_processed_requests_give_eager_steppings_outputs \
            tests/engine/test_prefix_cache.py::test_on_a_gpu_cached_prefixes_change_no_token \
            tests/engine/test_top_logprobs.py::test_on_a_gpu_alternatives_are_an_eager_engines \
            tests/engine/test_weight_updates.py
    else
        echo "gpu_tests: skipped (no pytest, pytest-xdist or pytest-timeout on this machine)" | tee -a "$OUT/summary.txt"
    fi
}

extras() {     # the kernels of stops 63-67 measured on a GPU (~2.5 min)
    # Qwen3.5's hybrid against an all-attention model of its width, plain and speculative (stop 66: its
    # Triton kernels never run on a GPU before; ~60 s)
    [ "$DEVICE" = cuda ] && step deltanet ${DELTANET_LIMIT:-90} \
        $PY benchmarks/deltanet.py --device cuda --rounds 2
    # gpt-oss's MXFP4 experts dequantized on the device against transformers' (stop 67; ~20 s)
    [ "$DEVICE" = cuda ] && step mxfp4 ${MXFP4_LIMIT:-40} \
        $PY benchmarks/mxfp4_load.py --device cuda --rounds 4
    # a CUDA graph's launch on the host by its kernels (stop 68: 0.25 ms a step's, ~290 kernels; ~10 s)
    [ "$DEVICE" = cuda ] && step graph_launch ${LAUNCH_LIMIT:-30} $PY benchmarks/graph_launch.py
    # a sliding window's attention against full attention (stop 63; Triton's compiles, then seconds)
    [ "$DEVICE" = cuda ] && step window ${WINDOW_LIMIT:-40} $PY benchmarks/sliding_window.py --rows 1,64 \
        --contexts 1024,8192 --rounds 4
}

drafter() {
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 60 $PY setup.py build_ext --inplace
    [ -d "$M" ] || step standin 60 $PY -c "from tailrl.cli import main; main(['make-model', '--standin', '0.5b', '--out', '$M'])"
    step train_drafter ${TRAIN_LIMIT:-75} $PY -c "from tailrl.cli import main; main(['train-drafter', '--model', '$M', \
'--out', '$D', '--device', '$DEVICE', $TRAIN_ARGS])"
    step drafter ${DRAFTER_LIMIT:-120} $PY benchmarks/drafter.py --device "$DEVICE" --model "$M" --drafter "$D" \
        --rounds 1 $ROLLOUT_ARGS
    # a chain depth on the engine's kernels (launched, from its graph) vs the padded eager step, two drafter sizes
    step drafter_step ${STEP_LIMIT:-60} $PY benchmarks/drafter_step.py --device "$DEVICE" ${QUICK:+--rounds 1}
    # whole drafter calls (catch-up, chains from graphs, trees) on the 0.5b stand-in, synchronised
    step drafter_call ${CALL_LIMIT:-60} $PY benchmarks/drafter_call.py --device "$DEVICE" --model "$M" --rounds 1
    # a drafter depth of Qwen2.5-0.5B's real shape (151,936-token head) from its graph, whole vs draft vocabulary
    step drafter_vocab ${VOCAB_LIMIT:-60} $PY benchmarks/drafter_vocab.py --device "$DEVICE" ${QUICK:+--rounds 1 --sizes 8192}
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/summary.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    >>"$OUT/summary.txt" 2>&1
case "${1:-}" in
all)
    engine
    if grep -q "^rollout: plain .* default" "$OUT/gpu.log"; then     # the engine's rollouts ran
        drafter
    else
        echo "drafter: skipped (benchmarks/gpu.py's rollouts did not run)" | tee -a "$OUT/summary.txt"
    fi
    ;;
engine) engine ;;
extras)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 60 $PY setup.py build_ext --inplace
    extras
    ;;
drafter) drafter ;;
grpo)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 60 $PY setup.py build_ext --inplace
    [ -d "$M" ] || step standin 60 $PY -c "from tailrl.cli import main; main(['make-model', '--standin', '0.5b', '--out', '$M'])"
    [ -f "$D/drafter.json" ] || step train_drafter ${TRAIN_LIMIT:-75} $PY -c "from tailrl.cli import main; \
main(['train-drafter', '--model', '$M', '--out', '$D', '--device', '$DEVICE', $TRAIN_ARGS])"
    step grpo ${GRPO_LIMIT:-420} $PY benchmarks/drafter_online.py --steps ${GRPO_STEPS:-20} --drafter "$D" \
        ${GRPO_RUNS:+--runs $GRPO_RUNS} --set device=$DEVICE --set model=$M --set gpu_memory_utilization=0.12 --out /tmp/tailrl-grpo
    ;;
profile)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 60 $PY setup.py build_ext --inplace
    step profile ${PROFILE_LIMIT:-130} $PY benchmarks/step_profile.py --device "$DEVICE" --standin-dir /tmp/tailrl-standins \
        ${QUICK:+--quick}
    ;;
host)
    [ -f tailrl/kernels/_gemm.cpython-*.so ] || step build 60 $PY setup.py build_ext --inplace
    step spec_host 500 $PY benchmarks/spec_host.py --rounds 2 --measured
    ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh all|engine|extras|drafter|grpo|profile|host" >&2
    exit 2
    ;;
esac
