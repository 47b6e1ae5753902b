#!/usr/bin/env bash
# The checks a machine with an NVIDIA GPU runs (CI has none; docs/BENCHMARKS.md "GPU" holds the figures):
#   1. the Triton kernel tests, compiled, on CUDA tensors, against their float64 references;
#   2. the kernel benchmark on the Triton backend (and the dense linears on cuBLAS);
#   3. the whole engine on CUDA against transformers + peft on the same GPU (greedy tokens, throughput),
#      fp32 and bf16, on the zoo's tiny and small models;
#   4. where a step's time goes on the GPU, mixed adapters and base only (`profile_engine`, small, bf16):
#      by category with synchronized timers, and the device's busy share under torch's profiler.
# Every engine run starts with the engine's warm-up (`worker.warmup`); bench_engine reports the kernel
# variants compiled in it and after it (`kernels_compiled_after_warmup`: 0 = nothing compiled while serving).
# Every step has its own time limit and its log under $OUT (default ./gpu-out); a failing step does not
# stop the others, and the script's exit status is the number of failed steps.
#
#     bash scripts/gpu_checks.sh [quick|warmup|graphs] # quick: no transformers runs, fewer benchmark
#                                               # repeats; warmup: the warm-up and busy-share figures first,
#                                               # then the Triton tests (a short lease's order); graphs: the
#                                               # engine with and without CUDA graphs, then the Triton tests
#
# Python packages: the GPU's own torch and triton; where a pinned pure-Python dependency is missing or
# another version there, `pip install --target` it and put it on PYTHONPATH first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LORAGATE_CACHE=${LORAGATE_CACHE:-/tmp/loragate-gpu-cache} TOKENIZERS_PARALLELISM=false
mode=${1:-full}
failed=0

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name rc=$rc in $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton, transformers, peft; print(sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
step zoo 100 python3 -c "from worker.modelzoo.make import ensure_zoo; print(ensure_zoo().root)"
if [ "$mode" = graphs ]; then
    # Decode steps replayed from CUDA graphs against the same engine without them, on one machine.
    for dtype in float32 bfloat16; do
        for graphs in on off; do
            sample=1
            [ "$dtype$graphs" = float32on ] && sample=4
            step "engine-small-$dtype-graphs-$graphs" 100 python3 -m loadtest.bench_engine --model small \
                --device cuda --dtype "$dtype" --skip-hf --check-sample "$sample" --cuda-graphs "$graphs"
        done
    done
    step busy-small-mixed-graphs 70 python3 -m loadtest.profile_engine --model small --device cuda \
        --dtype bfloat16 --requests 24 --kineto --cuda-graphs on
    step triton-tests 70 python3 -m pytest -q -n 8 --confcutdir=tests/kernels -W default -p no:cacheprovider \
        tests/kernels -k "triton and not interpreter"
    grep -h '^{' "$OUT"/engine-*.log "$OUT"/busy-*.log >"$OUT/results.jsonl" 2>/dev/null
    echo "failed steps: $failed"
    exit "$failed"
fi
if [ "$mode" = warmup ]; then
    step engine-small-bfloat16 150 python3 -m loadtest.bench_engine --model small --device cuda \
        --dtype bfloat16 --skip-hf --check-sample 2
    for kind in mixed base; do
        flag=()
        [ "$kind" = base ] && flag=(--base)
        step "busy-small-$kind" 70 python3 -m loadtest.profile_engine --model small --device cuda \
            --dtype bfloat16 --requests 24 --kineto "${flag[@]}"
    done
    step engine-small-float32 100 python3 -m loadtest.bench_engine --model small --device cuda \
        --dtype float32 --skip-hf --check-sample 3
    step triton-tests 80 python3 -m pytest -q -n 8 --confcutdir=tests/kernels -W default -p no:cacheprovider \
        tests/kernels -k "triton and not interpreter"
    grep -h '^{' "$OUT"/engine-*.log "$OUT"/busy-*.log >"$OUT/results.jsonl" 2>/dev/null
    echo "failed steps: $failed"
    exit "$failed"
fi
# The Triton tests only (the CPU paths are CI's), in parallel workers: each compiles its own variants.
workers=$(python3 -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
# shellcheck disable=SC2086
step triton-tests 200 python3 -m pytest -q $workers --confcutdir=tests/kernels -W default -p no:cacheprovider \
    tests/kernels -k "triton and not interpreter"
repeats=20
[ "$mode" = quick ] && repeats=5
step bench-kernels 120 python3 -m loadtest.bench_kernels --backend triton --repeats $repeats
hf=(--hf-batch-size 64)
[ "$mode" = quick ] && hf=(--skip-hf --check-sample 2)
for model in tiny small; do
    for dtype in float32 bfloat16; do
        step "engine-$model-$dtype" 120 python3 -m loadtest.bench_engine --model "$model" --device cuda \
            --dtype "$dtype" "${hf[@]}"
    done
done
for kind in mixed base; do
    flag=()
    [ "$kind" = base ] && flag=(--base)
    step "profile-small-$kind" 90 python3 -m loadtest.profile_engine --model small --device cuda \
        --dtype bfloat16 --requests 64 "${flag[@]}"
done
grep -h '^{' "$OUT"/bench-*.log "$OUT"/engine-*.log "$OUT"/profile-*.log >"$OUT/results.jsonl" 2>/dev/null
echo "failed steps: $failed"
exit "$failed"
