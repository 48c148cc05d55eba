#!/usr/bin/env bash
# The headline table of docs/PERFORMANCE.md: every headline claim's command, once each, in turn,
# each writing its --json into one folder; then scripts/perf_tables.py renders the table.
#
#   benchmarks/headline.sh [OUT_DIR]          # default: $TMPDIR/shardgen-headline (JSON, logs, headline.md)
#   ONLY="overhead skew" benchmarks/headline.sh   # a subset, by step name (docs left as they are)
#   scripts/perf_tables.py fill docs/PERFORMANCE.md OUT_DIR   # write a folder's tables into the doc
#
# Expected time: about 25 minutes on 2 idle CPU cores (the longest steps: train_pause 2 x 2.5 min
# + start-up, stationary 3-4 min, loading 3-4 min with its checkpoint made once in /tmp, anchors
# 3-5 min); the one run so far, at a load average of 5-21 from other work, took 41 minutes of steps
# (plus 10 minutes that the DeepSpeed steps waited on a stale build lock). Each step's wall time
# goes to OUT_DIR/times.txt. A step that fails is reported and the run goes on; its row then reads
# "not run". Settings are each benchmark's smallest that still shows its claim; the sections of
# docs/PERFORMANCE.md give the larger runs behind them.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/shardgen-headline}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
export PYTHONPATH=src OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
: > "$OUT/times.txt"
echo "Run at \`$(git rev-parse --short HEAD)\`$(git diff --quiet HEAD -- src benchmarks || echo ' (with uncommitted changes)'), $(date -u '+%Y-%m-%d %H:%M UTC'); load average before: $(cut -d' ' -f1-3 /proc/loadavg)." > "$OUT/run.txt"
CKPT=${CKPT:-/tmp/llama-320m}

step() {  # step NAME COMMAND...: run unless ONLY excludes it, time it, keep going on failure
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: $*"
  local t0=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then rc=0; else rc=$?; fi
  echo "$name $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.log"
}

step overhead   $PY benchmarks/overhead.py --gather per-layer --rounds 4 --json "$OUT/overhead.json"
step sampling   $PY benchmarks/sampling.py --vocab 72,32000 --rounds 7 --json "$OUT/sampling.json"
step skew       $PY benchmarks/skew.py --gather per-layer --prompts 32 --rounds 2 --json "$OUT/skew.json"
step rollout    $PY benchmarks/rollout_throughput.py --gather per-layer --prompts 32 --samples 2 --rounds 2 --json "$OUT/rollout.json"
step bench      $PY -m shardgen bench --world-sizes 2 --json "$OUT/bench.json"
step ds_decode  $PY benchmarks/ds_decode.py --sizes tiny --offload both --rounds 2 --json "$OUT/ds_decode.json"
step gather_once $PY benchmarks/gather_once.py --rounds 2 --json "$OUT/gather_once.json"
step anchors    $PY benchmarks/anchors.py --workloads toy medium --ns 4 --rounds 1 --json "$OUT/anchors.json"
step stationary_toy $PY benchmarks/stationary.py --part toy --rounds 2 --json "$OUT/stationary_toy.json"
step hybrid     $PY benchmarks/hybrid.py --rounds 2 --json "$OUT/hybrid.json"
step tail       $PY benchmarks/tail.py --prompts 400 --nproc 4 --rounds 1 --workloads bounded --json "$OUT/tail.json" --extra --batch-size 16
step prefill_share  $PY benchmarks/prefill.py --part share --share-workloads 512-token --ns 4 --rounds 1 --json "$OUT/prefill_share.json"
step prefill_budget $PY benchmarks/prefill.py --part budget --budgets none 1024 --rounds 2 --json "$OUT/prefill_budget.json"
step stationary $PY benchmarks/stationary.py --part throughput --world 2 --rounds 2 --pin --json "$OUT/stationary.json"
[ -e "$CKPT/config.json" ] || step loading_make $PY benchmarks/loading.py --make "$CKPT"
step loading    $PY benchmarks/loading.py --model "$CKPT" --nproc 2 --backends fsdp2 deepspeed \
                    --methods full sharded --dtype bfloat16 --json "$OUT/loading.json"
step train_pause $PY benchmarks/train_pause.py --modes fsdp2 deepspeed --max-minutes 2.5 --until-ci 5 \
                    --max-rounds 400 --json "$OUT/train_pause.json"

echo "Load average after: $(cut -d' ' -f1-3 /proc/loadavg); wall time of the steps: $(awk '{s+=$2} END {print s}' "$OUT/times.txt") s." >> "$OUT/run.txt"
$PY scripts/perf_tables.py headline "$OUT" > "$OUT/headline.md" && cat "$OUT/headline.md" "$OUT/run.txt"
# The whole run (no ONLY): write its tables into docs/PERFORMANCE.md (every marked block).
[ -n "${ONLY:-}" ] || $PY scripts/perf_tables.py fill docs/PERFORMANCE.md "$OUT"
