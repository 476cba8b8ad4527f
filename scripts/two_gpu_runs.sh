#!/bin/bash
# The runs that need two GPUs (the device kind nvidia-h200-x2), each stage sized for one 10-minute device call.
#
#   scripts/two_gpu_runs.sh OUT STAGE [...]   runs the stages in order, from the repository root, through
#                                           scripts/sglang_bundle.sh (its parts in .bundle/), each under
#                                           `timeout LIMIT` (default 540 s); writes OUT/STAGE.log and
#                                           OUT/stages.tsv (stage, exit status, wall seconds).
#   scripts/two_gpu_runs.sh --list            the stages and their commands.
#
# Stages:
#   matrix      the settings matrix's TP 2 cells (tp2, tp2-graphs) for NONE, DFLASH, NGRAM and REFCHECK_DDTREE,
#               default diff options, two engines side by side: OUT/matrix/ (matrix.json, matrix.md; merge into
#               the matrix table with scripts/matrix_table.py)
#   build64     the 64-layer real-width pair (Qwen3.6-27B's shape, 57.5 GB bf16) built on the GPU into $PAIR64
#               (default /tmp/real64; the disk must hold it beside the bundle)
#   ddtree64    REFCHECK_DDTREE b15 at TP 2 on the 64-layer pair, diffed with default options (fp32 reference on
#               the GPU, then a bf16 replay): trace bytes per verify step, diffed steps per second (OUT/real64/)
#   dflash64    DFLASH b15 likewise
#   ngram64     NGRAM (budget 11, breadth 10) likewise
#   fault64     REFCHECK_DDTREE b15 at TP 2 with the mamba state committed from the flat index (the injected
#               algorithm REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX): must fail in conv at its onset step
#               (OUT/real64-fault/)
# The clean runs of ddtree64, dflash64 and ngram64 must pass: they are the calibrated verdict's false-alarm
# check at full depth. OUT/real64/summary.json and OUT/real64-fault/summary.json hold the verdicts and numbers.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
STAGES=(matrix build64 ddtree64 dflash64 ngram64 fault64)
PAIR64=${PAIR64:-/tmp/real64}

stage_cmd() {
  local out=$1
  case "$2" in
    matrix) echo "$HERE/sglang_bundle.sh run python3 -m refcheck matrix --settings tp2,tp2-graphs --parallel 2 --out $out/matrix" ;;
    build64) echo "python3 $HERE/real_width.py build --out $PAIR64 --layers 64 --device cuda" ;;
    ddtree64) echo "$HERE/sglang_bundle.sh run python3 $HERE/real_width.py run --pair-dir $PAIR64 --out $out/real64 --algorithms REFCHECK_DDTREE --tp 2" ;;
    dflash64) echo "$HERE/sglang_bundle.sh run python3 $HERE/real_width.py run --pair-dir $PAIR64 --out $out/real64 --algorithms DFLASH --tp 2" ;;
    ngram64) echo "$HERE/sglang_bundle.sh run python3 $HERE/real_width.py run --pair-dir $PAIR64 --out $out/real64 --algorithms NGRAM --tp 2" ;;
    fault64) echo "$HERE/sglang_bundle.sh run python3 $HERE/real_width.py run --pair-dir $PAIR64 --out $out/real64-fault --algorithms REFCHECK_DDTREE_FAULT_MAMBA_FLAT_INDEX --tp 2 --no-bf16-replay" ;;
    *) return 1 ;;
  esac
}

if [ "${1:-}" = "--list" ]; then
  for s in "${STAGES[@]}"; do printf '%-9s %s\n' "$s" "$(stage_cmd OUT "$s")"; done
  exit 0
fi
OUT=${1:?usage: scripts/two_gpu_runs.sh OUT STAGE [...] | --list}
shift
[ $# -gt 0 ] || { echo "two_gpu_runs: name the stages to run (--list names them)" >&2; exit 2; }
for s in "$@"; do
  stage_cmd "$OUT" "$s" >/dev/null || { echo "two_gpu_runs: unknown stage '$s' (--list names them)" >&2; exit 2; }
done
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
  echo "two_gpu_runs: these runs need two GPUs, this machine has $gpus" >&2
  exit 3
fi
mkdir -p "$OUT" || exit 2
cd "$REPO"
LIMIT=${LIMIT:-540}
export REFCHECK_SGLANG_START_LOCK=${REFCHECK_SGLANG_START_LOCK:-$OUT/.sglang-start.lock}
for s in "$@"; do
  start=$EPOCHREALTIME
  timeout "$LIMIT" $(stage_cmd "$OUT" "$s") >"$OUT/$s.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$s" "$rc" "$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')" >> "$OUT/stages.tsv"
done
cat "$OUT/stages.tsv"
