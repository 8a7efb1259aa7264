#!/usr/bin/env bash
# One short GPU lease in one command: the GPU suite (tests/gpu) and the GPU benches, each part under its own time
# limit, everything returned as ONE archive, $OUT/gpu-check.tgz, and a summary.txt beside it (each part's exit
# status, seconds and limit). A lease returns at most 8 files, so the parts write into a per-run scratch folder
# (mktemp -d), which is packed again after every part (written as .new, then renamed): a command killed at its
# limit still returns every part that finished.
#
#     bash bench/gpu_check.sh --prepare-wheels   # here, with internet: vidmem's wheels into .whl/ (Python 3.12, x86-64)
#     OUT=/some/folder bash bench/gpu_check.sh   # there (PyTorch, Triton, no internet, no diffusers); OUT defaults to
#                                                # ./gpu-check; carry .whl/ with the tree
#     OUT=/tmp/gc bash bench/gpu_check.sh --dry-run   # anywhere: the same parts on the CPU at tiny sizes (a minute or
#                                                # two with OMP_NUM_THREADS=1): the archive and summary appear
#     bash bench/gpu_check.sh --help              # this text
# Without --dry-run it stops at once (exit 3) where torch sees no CUDA device.
#
# The parts, in the order they run (a variable each, its seconds; 0 skips the part): the defaults' plan first, then
# the parts earlier leases measured, which default to 0 (their figures: docs/gpu.md, docs/speed.md,
# docs/step-cache.md; give them seconds on a GPU kind not measured before):
#   SUITE_SECONDS        the suite tests/gpu (SUITE_SELECT: a pytest -k expression)
#   ACT_SECONDS          one real-size Wan 14B block per activation_chunks count at 720p and 480p, eager, profiled
#                        (bench/activations.py: peak against the plan, time against unchunked, where the time goes)
#   GOAL_SECONDS         issue 24's goal at 832x480x81 on GOAL_MODEL's widths: compiled blocks with the GOAL_ROWS
#                        rows (kernel and fp8 matmul, in the order given), against eager SDPA with fp8 weights upcast,
#                        tiers none and block swap of all 4 blocks (bench/speed.py --parts goal)
#   ACT_COMPILE_SECONDS  the activation block compiled at 480p
#   COMPILE_SECONDS      compiled blocks against eager at 832x480x81 on COMPILE_TIERS (tier+lora: a rank-32 LoRA on
#                        every block's linear layers)
#   WARM_SECONDS STREAM_SECONDS SPEED_SECONDS CACHE_SECONDS FP8_SECONDS ATTN_SECONDS DECODE_SECONDS
#                        the 1.3B's warm rows, its blocks all streamed with and without pinned homes, the speed bench,
#                        its cache part, fp8 matmul and one attention call per kernel at 832x480x81, the VAE decode
#   then the 14B bench (BENCH_ROWS) in what is left of BUDGET_SECONDS less SANITIZE_SECONDS, and compute-sanitizer's
#   memcheck and racecheck over one tiny block swap step in SANITIZE_SECONDS, kept for last.
# No part runs into SANITIZE_SECONDS or past BUDGET_SECONDS (585, setup included, inside a lease command's 600 s):
# each part's limit is its seconds or what is left less 10 s (a part that ignores the TERM at its limit is killed
# 10 s later), and a part left under 20 s is skipped. Each JSON is rewritten after every row and lists rows it had
# no time for. The plan is printed first.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {  # the comment block above, without its '#'
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

# The wheels for a Python 3.12 x86-64 GPU machine: what vidmem imports that such an image lacks.
WHEELS="diffusers==0.42.1 gguf==0.19.0 ftfy==6.3.1 wcwidth==0.9.4 websocket-client==1.9.2 importlib_metadata==10.2.0 lazy-importer==0.1.0 sageattention==1.0.6"
[ $# -le 1 ] || { echo "bench/gpu_check.sh: one argument at most, got: $*; see --help" >&2; exit 2; }
DRY_RUN=
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --prepare-wheels)
        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
        exit ;;
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "bench/gpu_check.sh: unknown argument '$1'; it takes one of --help, --dry-run, --prepare-wheels, or none" >&2
       exit 2 ;;
esac

started=$(date +%s)
BUDGET_SECONDS=${BUDGET_SECONDS:-585}
KILL_GRACE=10  # `timeout -k`: a part still running this long after its TERM is killed
STOP_GRACE=3  # on a TERM or INT to the script: how long the part under way may take to end before the last pack
PART_PID=  # the part under way (its `timeout`), for stop()
# 132 s for 30 tests on the H200 (2026-11-28); 2 LoRA compile tests since. Tests are listed as they end (-v).
SUITE_SECONDS=${SUITE_SECONDS:-180}
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
# Right after the eager activation block, so that the compiled parts cannot take its time. By default its two auto
# rows (4 tier rows, ~130 s with the 14B's build), fp8 matmul on first: the fastest on the 1.3B, the row whose block
# swap overhead decides the 3% verdict. sage 1.0.6 was slower than SDPA's own kernel at this token count on the H200,
# and the 14B's attention is the same kernel over more heads. GOAL_ROWS= (empty) runs all four.
GOAL_SECONDS=${GOAL_SECONDS:-160}
GOAL_ROWS=${GOAL_ROWS-auto+fp8_on,auto+fp8_off}  # the goal's rows in the order run, comma-separated (--goal-rows)
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

# The parts in the order they run: its seconds' variable, its name in the summary, the function that runs it.
PARTS=(
    "SUITE_SECONDS|tests/gpu|suite"
    "ACT_SECONDS|activation block|activation_block"
    "GOAL_SECONDS|speed goal|speed_goal"
    "ACT_COMPILE_SECONDS|activation block compiled|activation_block_compiled"
    "COMPILE_SECONDS|compiled blocks|compiled_blocks"
    "WARM_SECONDS|warm rows|warm_rows"
    "STREAM_SECONDS|stream rows|stream_rows"
    "SPEED_SECONDS|speed bench|speed_bench"
    "CACHE_SECONDS|cache bench|cache_bench"
    "FP8_SECONDS|fp8 matmul|fp8_matmul"
    "ATTN_SECONDS|attention calls|attention_calls"
    "DECODE_SECONDS|VAE decode|vae_decode"
)

# --- the parts: each prints what it runs and calls `run LOG SHOW COMMAND...`; ${DRY_RUN:+...} is the CPU form ----

suite() {
    echo "== tests/gpu (at most ${LIMIT}s)"
    run gpu-suite.log '' python3 -m pytest -v -rA -s tests/gpu -p no:cacheprovider ${SUITE_SELECT:+-k "$SUITE_SELECT"}
}

activation_block() {
    echo "== bench/activations.py: one Wan 14B block per chunk count, 32,760 and 75,600 tokens (at most ${LIMIT}s)"
    run activations.log 'tokens, chunks|profile at|goals|Error' python3 bench/activations.py --device cuda --chunks 1,2,4,8,16 --runs 5 --profile --json "$RUN/activations-gpu.json" \
        ${DRY_RUN:+--device cpu --tiny --tokens 64,96 --chunks 1,2 --runs 2}
}

speed_goal() {
    echo "== bench/speed.py --parts goal: rows ${GOAL_ROWS:-all}, $GOAL_MODEL blocks, 832x480x81 (at most ${LIMIT}s)"
    run speed-goal.log '^  goal|Error' python3 bench/speed.py --device cuda --parts goal --model "$GOAL_MODEL" --size 832x480x81 \
        --steps 2 --blocks 4 --runs 2 ${GOAL_ROWS:+--goal-rows "$GOAL_ROWS"} --json "$RUN/speed-goal-gpu.json" \
        ${DRY_RUN:+--device cpu --size 64x64x5 --steps 1 --blocks 2 --runs 1 --compile-backend aot_eager}
}

activation_block_compiled() {
    echo "== bench/activations.py --compile: one Wan 14B block compiled per chunk count, 32,760 tokens (at most ${LIMIT}s)"
    run activations-compiled.log 'tokens, chunks|profile at|goals|Error' python3 bench/activations.py --device cuda --compile --tokens 32760 --chunks 1,2,4 \
        --runs 5 --profile --json "$RUN/activations-compiled-gpu.json" ${DRY_RUN:+--device cpu --tiny --tokens 64 --chunks 1,2 --runs 1}
}

compiled_blocks() {
    echo "== bench/speed.py: compiled blocks against eager at 832x480x81, tiers $COMPILE_TIERS (at most ${LIMIT}s)"
    run speed-compile.log '^  compile |Error' python3 bench/speed.py --device cuda --parts compile --size 832x480x81 --steps 2 --blocks 4 \
        --runs 3 --compile-tiers "$COMPILE_TIERS" --json "$RUN/speed-compile-gpu.json" \
        ${DRY_RUN:+--device cpu --size 64x64x5 --steps 1 --blocks 4 --runs 1 --compile-backend aot_eager}
}

warm_rows() {
    echo "== bench/gpu.py warm rows on $WARM_MODEL (at most ${LIMIT}s)"
    run bench-warm.log '' python3 bench/gpu.py --model "$WARM_MODEL" --rows "$WARM_ROWS" --json "$RUN/gpu-warm.json" \
        --budget-seconds $(( LIMIT > 40 ? LIMIT - 30 : 10 )) ${DRY_RUN:+--device cpu --rows warm_none,warm_model}
}

stream_rows() {
    echo "== bench/gpu.py rows $STREAM_ROWS on $WARM_MODEL (at most ${LIMIT}s)"
    run bench-stream.log '' python3 bench/gpu.py --model "$WARM_MODEL" --rows "$STREAM_ROWS" --json "$RUN/gpu-stream.json" \
        --budget-seconds $(( LIMIT > 25 ? LIMIT - 15 : 10 )) ${DRY_RUN:+--device cpu --rows block_swap_6,block_swap_6_unpinned}
}

speed_bench() {
    echo "== bench/speed.py: attention kernels, compiled blocks, fp8 matmul on 1.3B-sized blocks (at most ${LIMIT}s)"
    run speed.log '' python3 bench/speed.py --device cuda --parts attention,compile,fp8_matmul --steps 4 --blocks 8 \
        --runs 2 --json "$RUN/speed-gpu.json" ${DRY_RUN:+--device cpu --steps 1 --blocks 2 --runs 1 --compile-backend aot_eager}
}

cache_bench() {
    echo "== bench/speed.py: the step cache's blocks, copies and time per tier, 30 steps (at most ${LIMIT}s)"
    run speed-cache.log '' python3 bench/speed.py --device cuda --parts cache --steps 30 --blocks 8 \
        --runs 2 --json "$RUN/speed-cache-gpu.json" ${DRY_RUN:+--device cpu --steps 4 --blocks 2 --runs 1}
}

fp8_matmul() {
    echo "== bench/speed.py: fp8 matmul at the 1.3B's real size, 832x480x81 (at most ${LIMIT}s)"
    run speed-fp8.log '' python3 bench/speed.py --device cuda --parts fp8_matmul --size 832x480x81 --steps 2 --blocks 4 \
        --runs 2 --json "$RUN/speed-fp8-gpu.json" ${DRY_RUN:+--device cpu --size 64x64x5 --steps 1 --blocks 2 --runs 1}
}

attention_calls() {
    echo "== bench/speed.py: one attention call per kernel at 832x480x81, 32,760 tokens (at most ${LIMIT}s)"
    run speed-attention-call.log '^  [a-z_]+:|Error' python3 bench/speed.py --device cuda --parts attention_call --size 832x480x81 \
        --steps 1 --blocks 1 --json "$RUN/speed-attention-call-gpu.json" ${DRY_RUN:+--device cpu --size 64x64x5}
}

vae_decode() {
    echo "== bench/gpu.py --decode: Wan 2.1's VAE at 832x480x81, host copies overlapped or blocking (at most ${LIMIT}s)"
    run bench-decode.log 'seconds|same_frames|overlapped_over|peak|tiling|Error' python3 bench/gpu.py --decode --model "$WARM_MODEL" \
        --json "$RUN/gpu-decode.json" --budget-seconds $(( LIMIT > 40 ? LIMIT - 30 : 10 )) ${DRY_RUN:+--device cpu}
}

bench_14b() {  # the 14B bench's rows in what is left (its limit 50 s over the rows' budget: the row started finishes)
    echo "== bench/gpu.py on Wan 14B, rows ${BENCH_ROWS:-all} ($(( LIMIT - 50 ))s left for rows)"
    run bench.log '' python3 bench/gpu.py --json "$RUN/gpu.json" --budget-seconds $(( LIMIT - 50 )) ${BENCH_ROWS:+--rows "$BENCH_ROWS"} \
        ${DRY_RUN:+--device cpu --rows resident,sequential}
}

# --- the machinery: limits, running, the summary and the archive -------------------------------------------------

# Whether a part runs (whole seconds given, and 20 or more of them left), with its time limit in LIMIT: its own
# seconds, or what is left of BUDGET_SECONDS less SANITIZE_SECONDS (compute-sanitizer's, kept for last) and less the
# kill grace, if less, so that no part runs past the lease command's own limit. A skip goes in the summary.
part() {
    local seconds=$1 name=$2
    [[ "$seconds" =~ ^(0|[1-9][0-9]*)$ ]] || { skip "$name" "'$seconds' is not a whole number of seconds"; return 1; }
    [ "$seconds" -gt 0 ] || { skip "$name" "0 seconds given"; return 1; }
    local left=$(( BUDGET_SECONDS - ($(date +%s) - started) - SANITIZE_SECONDS - KILL_GRACE ))
    LIMIT=$(( seconds < left ? seconds : left ))
    [ "$LIMIT" -ge 20 ] || { skip "$name" "${LIMIT}s for it: $seconds given, ${left}s left"; return 1; }
}

skip() {
    echo "== $1 skipped: $2"
    record "$1" "skipped: $2" - - -
}

# COMMAND under LIMIT, TERM then KILL_GRACE later KILL, its output in $RUN/LOG; the lines matching SHOW (a grep -E
# pattern, '' for all) are shown, the last 40 of them. Then the summary and the archive are written again.
# It runs in the background and is waited for: `timeout` moves itself and the bench into their own process group,
# where a TERM to the script's group does not reach, and bash runs its TERM trap only once a foreground command
# ends (the part's whole limit), whereas a `wait` ends at once on a trapped signal and stop() passes the TERM on.
run() {
    local rc
    PART_LOG=$1 PART_SHOW=$2 PART_BEGUN=$(date +%s)
    shift 2
    timeout -k "$KILL_GRACE" "$LIMIT" "$@" > "$RUN/$PART_LOG" 2>&1 &
    PART_PID=$!
    wait "$PART_PID"
    rc=$?
    part_ended "exit $rc" "$([ "$rc" -eq 124 ] && echo ' (its time limit)')"
    PART_PID=
    pack
}

part_ended() {  # RESULT [NOTE]: the part's last log line, its lines and result on screen, its row in the summary
    local seconds=$(( $(date +%s) - PART_BEGUN ))
    echo "$1 after ${seconds}s of ${LIMIT}s" >> "$RUN/$PART_LOG"
    grep -E "$PART_SHOW" "$RUN/$PART_LOG" | grep -v "^Failed to load CPU" | tail -n 40
    echo "-- $PART_NAME: $1${2:-} after ${seconds}s of ${LIMIT}s"
    record "$PART_NAME" "$1" "$seconds" "$LIMIT" "$PART_LOG"
}

# A TERM or INT (a lease's stop, which sends KILL some seconds later; ^C): the part under way, if any, is passed a
# TERM (its `timeout` passes it to the bench, and KILLs it KILL_GRACE later) and given STOP_GRACE seconds to end, so
# that its last output is packed whole; its row goes in the summary, then the exit trap packs.
stop() {
    local signal=$1 status=$2
    trap '' TERM INT  # a second signal must not cut the last pack short
    if [ -n "$PART_PID" ]; then
        kill -TERM "$PART_PID" 2>/dev/null
        for _ in $(seq $(( STOP_GRACE * 10 ))); do part_running || break; sleep 0.1; done
        part_ended "interrupted ($signal)"
    fi
    exit "$status"
}

part_running() {  # whether the part's `timeout` still runs: neither ended and reaped by bash nor a zombie (Z)
    local state
    state=$(ps -o stat= -p "$PART_PID" 2>/dev/null) && [[ $state != Z* ]]
}

record() {  # one tab-separated line of the summary: part, result, seconds, limit, log
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$RUN/summary.txt"
}

# The scratch folder as one archive, and the summary beside it, each written whole and renamed onto the last
# (a lease returns what is under $OUT even when its command is killed: the archive of the parts done by then).
pack() {
    tar czf "$OUT/gpu-check.tgz.new" -C "$WORK" gpu-check && mv -f "$OUT/gpu-check.tgz.new" "$OUT/gpu-check.tgz"
    cp "$RUN/summary.txt" "$OUT/summary.txt.new" && mv -f "$OUT/summary.txt.new" "$OUT/summary.txt"
}

finish() {  # at any exit once the scratch folder exists: the last archive, then the scratch folder removed
    local rc=$?
    echo "# done: exit $rc after $(( $(date +%s) - started ))s" >> "$RUN/summary.txt"
    pack
    echo "wrote $OUT/gpu-check.tgz ($(du -k "$OUT/gpu-check.tgz" | cut -f1) KiB) and $OUT/summary.txt"
    rm -rf "$WORK"
    exit "$rc"
}

print_plan() {
    echo "plan: ${BUDGET_SECONDS}s in all, setup included; each part at most its seconds or what is left (less" \
         "${SANITIZE_SECONDS}s kept for compute-sanitizer and ${KILL_GRACE}s of kill grace); under 20 s left, skipped"
    local entry variable name
    for entry in "${PARTS[@]}"; do
        IFS='|' read -r variable name _ <<< "$entry"
        printf '  %-26s %-20s %s\n' "$name" "$variable" "${!variable}"
    done
    printf '  %-26s %-20s %s\n' "14B bench" "(what is left)" "rows ${BENCH_ROWS:-all}" \
        "compute-sanitizer" "SANITIZE_SECONDS" "$SANITIZE_SECONDS"
}

# --- setup: CUDA first, then a per-run scratch folder, the wheels, the package, the versions ------------------------

if [ -z "$DRY_RUN" ]; then  # nothing is created or installed where there is no GPU to measure
    if ! cuda=$(timeout 60 python3 -c "import torch; print(torch.cuda.is_available())" 2>&1) || [ "${cuda##*$'\n'}" != True ]; then
        echo "bench/gpu_check.sh: no CUDA device for torch here; python3 -c 'print(torch.cuda.is_available())' said:" >&2
        tail -n 3 <<< "$cuda" | sed 's/^/    /' >&2
        echo "run it on a GPU machine, or 'bash bench/gpu_check.sh --dry-run' for the CPU rehearsal" >&2
        exit 3
    fi
fi
OUT=${OUT:-$PWD/gpu-check}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vidmem-check.XXXXXX") || exit
RUN=$WORK/gpu-check  # the archive's one folder
mkdir -p "$OUT" "$RUN" "$WORK/pkg" || exit
printf '# bench/gpu_check.sh%s, %s\npart\tresult\tseconds\tlimit\tlog\n' "${DRY_RUN:+ --dry-run}" "$(date -u '+%F %T UTC')" \
    > "$RUN/summary.txt"
trap finish EXIT
trap 'stop TERM 143' TERM
trap 'stop INT 130' INT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
print_plan
if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl || exit
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The repository root is the `vidmem` package: make it importable under that name, for this run only.
ln -s "$PWD" "$WORK/pkg/vidmem"
export PYTHONPATH=$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}
if ! failed=$(timeout 60 python3 -c "import diffusers" 2>&1); then
    echo "diffusers is not importable here; python3 -c 'import diffusers' said:"
    tail -n 8 <<< "$failed" | sed 's/^/    /'
    echo "if it is missing, run 'bash bench/gpu_check.sh --prepare-wheels' where there is internet and carry .whl/ with the tree"
    exit 2
fi
timeout 60 nvidia-smi > "$RUN/nvidia-smi.txt" 2>&1
timeout 60 python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', \
diffusers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" | tee -a "$RUN/nvidia-smi.txt"
pack

# --- the parts ----------------------------------------------------------------------------------------------------

for entry in "${PARTS[@]}"; do
    IFS='|' read -r variable PART_NAME function <<< "$entry"
    if part "${!variable}" "$PART_NAME"; then "$function"; fi
done

PART_NAME="14B bench"
LIMIT=$(( BUDGET_SECONDS - ($(date +%s) - started) - SANITIZE_SECONDS - KILL_GRACE ))
if [ "$LIMIT" -gt 110 ]; then bench_14b; else skip "$PART_NAME" "$(( LIMIT - 50 ))s left for rows"; fi

for tool in memcheck racecheck; do  # each over one tiny block_swap step, in the SANITIZE_SECONDS kept for them
    PART_NAME="compute-sanitizer $tool"
    LIMIT=$(( BUDGET_SECONDS - ($(date +%s) - started) - KILL_GRACE ))
    [ "$SANITIZE_SECONDS" -gt 0 ] && [ "$LIMIT" -gt 30 ] && command -v compute-sanitizer >/dev/null || break
    echo "== compute-sanitizer $tool over one tiny block_swap step (at most ${LIMIT}s)"
    run "$tool.log" 'ERROR SUMMARY|sanitize step|Error' compute-sanitizer --tool "$tool" python3 bench/gpu.py --sanitize-step
done
echo "done in $(( $(date +%s) - started ))s"
