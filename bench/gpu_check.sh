#!/usr/bin/env bash
# One short GPU lease: the GPU suite (tests/gpu), the GPU bench's warm rows on Wan 2.1 1.3B and its
# other rows on Wan 14B (bench/gpu.py), and compute-sanitizer over one tiny block_swap step,
# everything written to one folder.
#
# On the GPU machine (PyTorch and Triton there, no internet, no diffusers), from the repository root:
#     OUT=/some/folder bash bench/gpu_check.sh
# The pack's other dependencies travel as wheels in .whl/ beside the tree; prepare them here first:
#     bash bench/gpu_check.sh --prepare-wheels
# Each part has its own time limit, an environment variable: the suite SUITE_SECONDS, the warm rows
# WARM_SECONDS, the 1.3B's blocks all streamed with and without pinned homes STREAM_SECONDS, the speed bench (bench/speed.py) SPEED_SECONDS, its cache part CACHE_SECONDS, fp8 matmul at
# 832x480x81 FP8_SECONDS, one attention call per kernel at that size ATTN_SECONDS, the VAE decode with and
# without overlapped host copies DECODE_SECONDS, one real-size Wan 14B block per activation_chunks count at
# 720p and 480p (bench/activations.py: peak against the plan, time against unchunked, where the time goes) ACT_SECONDS,
# the same compiled at 480p ACT_COMPILE_SECONDS, compiled blocks against eager at 832x480x81 on the tiers COMPILE_TIERS
# names (a tier+lora with a rank-32 LoRA on every block's linear layers) COMPILE_SECONDS, issue 24's goal at 832x480x81 on GOAL_MODEL's widths (compiled blocks with the GOAL_ROWS
# kernels, fp8 matmul off and on, against eager SDPA with fp8 weights upcast, tiers none and block swap of all 4
# blocks; bench/speed.py --parts goal) GOAL_SECONDS, the 14B bench
# (BENCH_ROWS) what is left of BUDGET_SECONDS less SANITIZE_SECONDS, which compute-sanitizer's memcheck and
# racecheck get last (each JSON is rewritten after every row and lists rows it had no time for). A part given
# 0 seconds is skipped, and no part runs into SANITIZE_SECONDS or past BUDGET_SECONDS: each part's limit is its
# seconds or what is left, if less (a part left under 20 s is skipped). The defaults are the next lease's plan, 575 s of parts within the 585 s
# budget (the suite 165 s, the activation block eager 70 and compiled 110, compiled blocks with and without a LoRA 70,
# the goal on 14B widths 160; each part usually ends before its limit): what no lease has measured yet, and the suite as the regression check; the parts earlier leases measured default to 0 (their figures:
# docs/gpu.md, docs/speed.md, docs/step-cache.md), so give them seconds on a GPU kind not measured before.
set -uo pipefail
cd "$(dirname "$0")/.."

# The wheels for a Python 3.12 x86-64 GPU machine: what vidmem imports that such an image lacks.
WHEELS="diffusers==0.42.1 gguf==0.19.0 ftfy==6.3.1 wcwidth==0.9.4 websocket-client==1.9.2 importlib_metadata==10.2.0 lazy-importer==0.1.0 sageattention==1.0.6"
if [ "${1:-}" = "--prepare-wheels" ]; then
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
    exit
fi

started=$(date +%s)
BUDGET_SECONDS=${BUDGET_SECONDS:-585}
SUITE_SECONDS=${SUITE_SECONDS:-165}  # 132 s for 30 tests on the H200 (2026-11-28); 2 LoRA compile tests since
WARM_SECONDS=${WARM_SECONDS:-0}  # measured on the H200, the keep row after its fix too (give it 90 for all four rows)
STREAM_SECONDS=${STREAM_SECONDS:-0}  # measured on the H200 (give it 40)
SPEED_SECONDS=${SPEED_SECONDS:-0}  # measured on the H200 (give it 90)
CACHE_SECONDS=${CACHE_SECONDS:-0}  # measured on the H200 (give it 100)
FP8_SECONDS=${FP8_SECONDS:-0}  # measured on the H100 (give it 60)
ATTN_SECONDS=${ATTN_SECONDS:-0}  # measured on the H100 (give it 60)
DECODE_SECONDS=${DECODE_SECONDS:-0}  # measured on the H200 after the landing fixes (2026-11-28; give it 100)
# Measured on the H200 since the queries are parked (2026-11-28, 55 s); again since the cross-attention's keys and
# values and the modulation are made once per block call, now with --profile: where each count's time goes.
ACT_SECONDS=${ACT_SECONDS:-70}
# The same block compiled at each chunk count at 480p (compiled chunked slices, not measured yet): 5 inductor
# compiles of a real 14B block (its forward, then 2 steps x 2 counts) in the untimed warm-ups, then profiled.
ACT_COMPILE_SECONDS=${ACT_COMPILE_SECONDS:-110}
# Compiled blocks against eager with a LoRA on every block's linear layers, then tier none without one, side by side,
# since a LoRA's hooks are traced into the graphs (not measured yet; 38 s for two tiers on the H200, the second reusing
# the first's compile: each tier here compiles from nothing); the JSON is rewritten after each tier
COMPILE_SECONDS=${COMPILE_SECONDS:-70}
# Issue 24's goal on 14B-wide blocks (not measured yet; the 1.3B's: H200, 2026-11-28, 120 s gave 7 of its 8 tier rows).
# By default its two auto rows (4 tier rows, ~130 s with the 14B's build): sage 1.0.6 was slower than SDPA's own kernel
# at this token count on the H200, and the 14B's attention is the same kernel over more heads. GOAL_ROWS= (empty) runs all four.
GOAL_SECONDS=${GOAL_SECONDS:-160}
GOAL_ROWS=${GOAL_ROWS-auto+fp8_off,auto+fp8_on}  # the goal's rows, comma-separated (bench/speed.py --goal-rows)
# The goal's blocks: the 14B's widths (40 heads, feed-forward 13,824; not measured yet), or wan2.1-t2v-1.3b (measured on
# the H200, 2026-11-28: 1.23x). 4 blocks of 14B width are 1.4 B parameters: about 30 s more to build and store in fp8.
GOAL_MODEL=${GOAL_MODEL:-wan2.1-t2v-14b}
SUITE_SELECT=${SUITE_SELECT:-}  # a pytest -k expression: only those GPU tests (default all)
SANITIZE_SECONDS=${SANITIZE_SECONDS:-0}  # memcheck and racecheck ran on the H200 and the H100 (racecheck needs ~2 min)
COMPILE_TIERS=${COMPILE_TIERS:-none+lora,none}  # of none, block_swap_2, block_swap_4, sequential (4 blocks), each also +lora
# the 14B rows, comma-separated (empty: every row, as long as time lasts); by default leaf-level group offloading
# beside resident, block swap of all 40 blocks and sequential, in one run (the H100 never ran it)
BENCH_ROWS=${BENCH_ROWS-resident,block_swap_40,sequential,group_offload_leaf}
# Issue 22's goal is judged on the 1.3B at 832x480: every warm row of its 30 blocks (tests/test_gpu_bench.py checks the names).
WARM_MODEL=wan2.1-t2v-1.3b
WARM_ROWS=warm_none,warm_model,warm_block_swap_15,warm_block_swap_15_keep
STREAM_ROWS=block_swap_30,block_swap_30_unpinned  # every block streamed, from pinned homes and from none
for budget in BUDGET_SECONDS SANITIZE_SECONDS; do  # every part's limit is counted from these two
    [[ "${!budget}" =~ ^(0|[1-9][0-9]*)$ ]] || { echo "$budget='${!budget}' must be a whole number of seconds"; exit 2; }
done
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vidmem-site .whl/*.whl || exit
    export PYTHONPATH=/tmp/vidmem-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The repository root is the `vidmem` package: make it importable under that name.
mkdir -p /tmp/vidmem-pkg && ln -sfn "$PWD" /tmp/vidmem-pkg/vidmem
export PYTHONPATH=/tmp/vidmem-pkg${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import diffusers" 2>/dev/null || { echo "diffusers is not importable here: run 'bash bench/gpu_check.sh --prepare-wheels' where there is internet, and carry .whl/ with the tree"; exit 2; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/nvidia-smi.txt"
# Whether a part runs (whole seconds given, and 20 or more of them left), with its time limit in LIMIT: its own
# seconds, or what is left of BUDGET_SECONDS less SANITIZE_SECONDS (compute-sanitizer's, kept for last) if less, so
# that no part runs past the lease command's own limit.
part() {
    [[ "$1" =~ ^(0|[1-9][0-9]*)$ ]] || { echo "== $2 skipped: '$1' is not a whole number of seconds"; return 1; }
    [ "$1" -gt 0 ] || { echo "== $2 skipped (0 seconds given)"; return 1; }
    local left=$(( BUDGET_SECONDS - ($(date +%s) - started) - SANITIZE_SECONDS ))
    LIMIT=$(( $1 < left ? $1 : left ))
    [ "$LIMIT" -ge 20 ] || {
        echo "== $2 skipped (${LIMIT}s for it: $1 given, ${left}s left of BUDGET_SECONDS less SANITIZE_SECONDS)"; return 1; }
}

if part "$SUITE_SECONDS" "tests/gpu"; then
    echo "== tests/gpu (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 -m pytest -q -rA -s tests/gpu -p no:cacheprovider ${SUITE_SELECT:+-k "$SUITE_SELECT"} \
        > "$OUT/gpu-suite.log" 2>&1
    echo "suite exit $?" | tee -a "$OUT/gpu-suite.log"
    tail -n 25 "$OUT/gpu-suite.log"
fi

if part "$WARM_SECONDS" "the warm rows"; then
    echo "== bench/gpu.py warm rows on $WARM_MODEL (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/gpu.py --model "$WARM_MODEL" --rows "$WARM_ROWS" --json "$OUT/gpu-warm.json" \
        --budget-seconds $(( LIMIT > 40 ? LIMIT - 30 : 10 )) > "$OUT/bench-warm.log" 2>&1
    echo "warm bench exit $?" | tee -a "$OUT/bench-warm.log"
    grep -v "^Failed to load CPU" "$OUT/bench-warm.log"
fi

if part "$STREAM_SECONDS" "the unpinned stream rows"; then
    echo "== bench/gpu.py rows $STREAM_ROWS on $WARM_MODEL (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/gpu.py --model "$WARM_MODEL" --rows "$STREAM_ROWS" --json "$OUT/gpu-stream.json" \
        --budget-seconds $(( LIMIT > 25 ? LIMIT - 15 : 10 )) > "$OUT/bench-stream.log" 2>&1
    echo "stream bench exit $?" | tee -a "$OUT/bench-stream.log"
    grep -v "^Failed to load CPU" "$OUT/bench-stream.log"
fi

if part "$SPEED_SECONDS" "the speed bench"; then
    echo "== bench/speed.py: attention kernels, compiled blocks, fp8 matmul on 1.3B-sized blocks (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts attention,compile,fp8_matmul --steps 4 --blocks 8 \
        --runs 2 --json "$OUT/speed-gpu.json" > "$OUT/speed.log" 2>&1
    echo "speed bench exit $?" | tee -a "$OUT/speed.log"
    grep -v "^Failed to load CPU" "$OUT/speed.log" | tail -n 40
fi

if part "$CACHE_SECONDS" "the cache bench"; then
    echo "== bench/speed.py: the step cache's blocks, copies and time per tier, 30 steps (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts cache --steps 30 --blocks 8 \
        --runs 2 --json "$OUT/speed-cache-gpu.json" > "$OUT/speed-cache.log" 2>&1
    echo "cache bench exit $?" | tee -a "$OUT/speed-cache.log"
    grep -v "^Failed to load CPU" "$OUT/speed-cache.log" | tail -n 30
fi

if part "$FP8_SECONDS" "fp8 matmul at 832x480x81"; then
    echo "== bench/speed.py: fp8 matmul at the 1.3B's real size, 832x480x81 (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts fp8_matmul --size 832x480x81 --steps 2 --blocks 4 \
        --runs 2 --json "$OUT/speed-fp8-gpu.json" > "$OUT/speed-fp8.log" 2>&1
    echo "fp8 bench exit $?" | tee -a "$OUT/speed-fp8.log"
    grep -v "^Failed to load CPU" "$OUT/speed-fp8.log" | tail -n 20
fi

if part "$ATTN_SECONDS" "attention calls at 832x480x81"; then
    echo "== bench/speed.py: one attention call per kernel at 832x480x81, 32,760 tokens (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts attention_call --size 832x480x81 --steps 1 --blocks 1 \
        --json "$OUT/speed-attention-call-gpu.json" > "$OUT/speed-attention-call.log" 2>&1
    echo "attention call bench exit $?" | tee -a "$OUT/speed-attention-call.log"
    grep -E '^  [a-z_]+:' "$OUT/speed-attention-call.log"
fi

if part "$DECODE_SECONDS" "the VAE decode rows"; then
    echo "== bench/gpu.py --decode: Wan 2.1's VAE at 832x480x81, host copies overlapped or blocking (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/gpu.py --decode --model "$WARM_MODEL" --json "$OUT/gpu-decode.json" \
        --budget-seconds $(( LIMIT > 40 ? LIMIT - 30 : 10 )) > "$OUT/bench-decode.log" 2>&1
    echo "decode bench exit $?" | tee -a "$OUT/bench-decode.log"
    grep -E 'seconds|same_frames|overlapped_over|peak|tiling|Error' "$OUT/bench-decode.log" | head -n 20
fi

if part "$ACT_SECONDS" "the activation chunks block"; then
    echo "== bench/activations.py --device cuda: one Wan 14B block per chunk count, 32,760 and 75,600 tokens (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/activations.py --device cuda --chunks 1,2,4,8,16 --runs 5 --profile \
        --json "$OUT/activations-gpu.json" > "$OUT/activations.log" 2>&1
    echo "activations exit $?" | tee -a "$OUT/activations.log"
    grep -E 'tokens, chunks|profile at|goals|Error' "$OUT/activations.log"
fi

if part "$ACT_COMPILE_SECONDS" "the activation chunks block compiled"; then
    echo "== bench/activations.py --device cuda --compile: one Wan 14B block compiled per chunk count, 32,760 tokens (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/activations.py --device cuda --compile --tokens 32760 --chunks 1,2,4 \
        --runs 5 --profile --json "$OUT/activations-compiled-gpu.json" > "$OUT/activations-compiled.log" 2>&1
    echo "activations compiled exit $?" | tee -a "$OUT/activations-compiled.log"
    grep -E 'tokens, chunks|profile at|goals|Error' "$OUT/activations-compiled.log"
fi

if part "$COMPILE_SECONDS" "compiled blocks at 832x480x81"; then
    echo "== bench/speed.py: compiled blocks against eager at 832x480x81, tiers $COMPILE_TIERS (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts compile --size 832x480x81 --steps 2 --blocks 4 \
        --runs 3 --compile-tiers "$COMPILE_TIERS" --json "$OUT/speed-compile-gpu.json" > "$OUT/speed-compile.log" 2>&1
    echo "compile bench exit $?" | tee -a "$OUT/speed-compile.log"
    grep -E '^  compile |Error' "$OUT/speed-compile.log"
fi

if part "$GOAL_SECONDS" "the speed goal at 832x480x81"; then
    echo "== bench/speed.py --parts goal: the best settings against eager SDPA with fp8 upcast, $GOAL_MODEL blocks, 832x480x81 (at most ${LIMIT}s)"
    timeout "$LIMIT" python3 bench/speed.py --device cuda --parts goal --model "$GOAL_MODEL" --size 832x480x81 \
        --steps 2 --blocks 4 --runs 2 ${GOAL_ROWS:+--goal-rows "$GOAL_ROWS"} --json "$OUT/speed-goal-gpu.json" \
        > "$OUT/speed-goal.log" 2>&1
    echo "goal bench exit $?" | tee -a "$OUT/speed-goal.log"
    grep -E '^  goal|Error' "$OUT/speed-goal.log"
fi

left=$(( BUDGET_SECONDS - ($(date +%s) - started) - 60 - SANITIZE_SECONDS ))
if [ "$left" -gt 60 ]; then
    echo "== bench/gpu.py (${left}s left for rows)"
    timeout $(( left + 50 )) python3 bench/gpu.py --json "$OUT/gpu.json" --budget-seconds "$left" ${BENCH_ROWS:+--rows "$BENCH_ROWS"} \
        > "$OUT/bench.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/bench.log"
    grep -v "^Failed to load CPU" "$OUT/bench.log"
else
    echo "== bench/gpu.py skipped: ${left}s left for rows"
fi

for tool in memcheck racecheck; do  # each over one tiny block_swap step, in the SANITIZE_SECONDS kept for them
    left=$(( BUDGET_SECONDS - ($(date +%s) - started) ))
    [ "$SANITIZE_SECONDS" -gt 0 ] && [ "$left" -gt 40 ] && command -v compute-sanitizer >/dev/null || break
    echo "== compute-sanitizer $tool over one tiny block_swap step"
    timeout $(( left - 10 )) compute-sanitizer --tool "$tool" python3 bench/gpu.py --sanitize-step > "$OUT/$tool.log" 2>&1
    echo "$tool exit $?" | tee -a "$OUT/$tool.log"
    tail -n 5 "$OUT/$tool.log"
done
echo "done in $(( $(date +%s) - started ))s"
