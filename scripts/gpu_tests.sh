#!/bin/bash
# The GPU test slices, each sized to finish inside one 10-minute device call on one H200.
#
#   scripts/gpu_tests.sh OUT [SLICE ...]   runs the named slices side by side (default: all of them), each
#                                          under `timeout LIMIT` (default 540 s), and writes OUT/SLICE.log,
#                                          OUT/SLICE.xml (JUnit, per-test times) and OUT/slices.tsv (slice,
#                                          exit status, wall seconds, pytest's summary line).
#   scripts/gpu_tests.sh --list            the slices and what each runs.
#
# Slices (the README's "GPU tests" table has their measured times):
#   gpu          tests/test_gpu.py                      the reference on CUDA (no SGLang)
#   dflash       tests/test_gpu_sglang_dflash.py        DFLASH capture on/off, a scheduler killed mid-run
#   ddtree       tests/test_gpu_sglang_ddtree.py -k narrow   REFCHECK_DDTREE b15, b16, the leaky chain layout
#   ddtree-wide  tests/test_gpu_sglang_ddtree.py -k wide     REFCHECK_DDTREE b32, b64
#   graphs       tests/test_gpu_sglang_graphs.py        REFCHECK_DDTREE under CUDA graphs, target-only NONE
#   served       tests/test_gpu_sglang_served.py        a launch_server DFLASH server captured through its environment
# The SGLang slices run through scripts/sglang_bundle.sh (its parts in .bundle/). Side by side, their engines
# start one at a time (REFCHECK_SGLANG_START_LOCK), each taking SGLang's default share (0.3) of the memory.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SLICES=(gpu dflash ddtree ddtree-wide graphs served)

slice_cmd() {
  case "$1" in
    gpu) echo "python3 -m pytest -o addopts= -m gpu tests/test_gpu.py" ;;
    dflash) echo "$HERE/sglang_bundle.sh run python3 -m pytest -o addopts= -m sglang tests/test_gpu_sglang_dflash.py" ;;
    ddtree) echo "$HERE/sglang_bundle.sh run python3 -m pytest -o addopts= -m sglang tests/test_gpu_sglang_ddtree.py -k narrow" ;;
    ddtree-wide) echo "$HERE/sglang_bundle.sh run python3 -m pytest -o addopts= -m sglang tests/test_gpu_sglang_ddtree.py -k wide" ;;
    graphs) echo "$HERE/sglang_bundle.sh run python3 -m pytest -o addopts= -m sglang tests/test_gpu_sglang_graphs.py" ;;
    served) echo "$HERE/sglang_bundle.sh run python3 -m pytest -o addopts= -m sglang tests/test_gpu_sglang_served.py" ;;
    *) return 1 ;;
  esac
}

if [ "${1:-}" = "--list" ]; then
  for s in "${SLICES[@]}"; do printf '%-12s %s\n' "$s" "$(slice_cmd "$s")"; done
  exit 0
fi
OUT=${1:?usage: scripts/gpu_tests.sh OUT [SLICE ...] | --list}
shift
[ $# -gt 0 ] && WANT=("$@") || WANT=("${SLICES[@]}")
for s in "${WANT[@]}"; do
  slice_cmd "$s" >/dev/null || { echo "gpu_tests: unknown slice '$s' (--list names them)" >&2; exit 2; }
done
mkdir -p "$OUT" || exit 2
cd "$REPO"
# unpack the bundle once, before the slices race for it
if printf '%s\n' "${WANT[@]}" | grep -qv '^gpu$'; then
  "$HERE/sglang_bundle.sh" run python3 -c 'import sglang' || { echo "gpu_tests: the SGLang bundle does not load" >&2; exit 2; }
fi
LIMIT=${LIMIT:-540}
# engines of different slices start one at a time (refcheck/sglang/start_lock.py), then run side by side
export REFCHECK_SGLANG_START_LOCK=${REFCHECK_SGLANG_START_LOCK:-$OUT/.sglang-start.lock}
pids=()
for s in "${WANT[@]}"; do
  (
    start=$EPOCHREALTIME
    timeout "$LIMIT" $(slice_cmd "$s") -q -p no:cacheprovider --durations=0 --junitxml="$OUT/$s.xml" >"$OUT/$s.log" 2>&1
    rc=$?
    end=$EPOCHREALTIME
    summary=$(grep -E ' in [0-9.]+s' "$OUT/$s.log" | tail -1)
    printf '%s\t%s\t%s\t%s\n' "$s" "$rc" "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')" "$summary" >"$OUT/$s.tsv"
  ) &
  pids+=($!)
  sleep "${STAGGER:-5}"
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
printf 'slice\texit\twall_s\tsummary\n' >"$OUT/slices.tsv"
for s in "${WANT[@]}"; do cat "$OUT/$s.tsv" >>"$OUT/slices.tsv"; rm -f "$OUT/$s.tsv"; done
cat "$OUT/slices.tsv"
awk -F'\t' 'NR > 1 && $2 != 0 { bad = 1 } END { exit bad }' "$OUT/slices.tsv" || status=1
exit $status
