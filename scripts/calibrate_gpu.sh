#!/usr/bin/env bash
# The calibration corpus on one GPU in one command: SGLang's configurations (through the offline bundle,
# scripts/sglang_bundle.sh) side by side with the reference corpus (clean engines in bf16 and fp16, every
# injected fault), then one table of both: OUT/calibration.md and OUT/calibration.json.
#
#   scripts/calibrate_gpu.sh OUT                      the whole corpus (docs/calibration.md)
#   CONFIGS=none,dflash CAL_ARGS="--no-faults" scripts/calibrate_gpu.sh OUT    a part of it
#
# Knobs (environment): CONFIGS (sglang_suite configurations), PARALLEL engines side by side, MEM (each
# engine's mem_fraction_static), TOKENS per request, WORKERS (reference corpus processes), CAL_ARGS (extra
# refcheck calibrate options, e.g. --bounds ...), LIMIT (seconds for each half; the table is written
# from whatever finished), EXTRA (a directory of engine traces captured earlier, added to the table).
set -uo pipefail
OUT=${1:?usage: scripts/calibrate_gpu.sh OUT}
CONFIGS=${CONFIGS:-none,dflash,ngram,ddtree-b8,ddtree-b15,ddtree-b32,ddtree-b64,none-graphs,dflash-graphs,ngram-graphs,ddtree-b15-graphs,ddtree-b64-graphs,dflash-bs1,ngram-bs1,ddtree-b15-bs1,ddtree-b15-leaky}
LIMIT=${LIMIT:-480}
RUN="bash scripts/sglang_bundle.sh run"
mkdir -p "$OUT/suite" "$OUT/reference"
t0=$(date +%s)
if [ -n "$CONFIGS" ]; then
  timeout "$LIMIT" $RUN python3 scripts/sglang_suite.py --out "$OUT/suite" --configs "$CONFIGS" --parallel "${PARALLEL:-6}" \
    --stagger "${STAGGER:-10}" --mem-fraction "${MEM:-0.1}" --timeout "$LIMIT" --max-new-tokens "${TOKENS:-32}" \
    --no-bf16-replay > "$OUT/suite.log" 2>&1 &
  suite=$!
fi
# shellcheck disable=SC2086
timeout "$LIMIT" $RUN python3 -m refcheck calibrate --out "$OUT/reference" --device cuda --workers "${WORKERS:-6}" \
  --max-new-tokens "${TOKENS:-32}" --save-traces ${CAL_ARGS:-} > "$OUT/reference.log" 2>&1
echo "reference corpus: rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
[ -n "$CONFIGS" ] && { wait "$suite"; echo "sglang suite: rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"; }
rows=()
[ -f "$OUT/reference/calibration.json" ] && rows=(--rows "$OUT/reference/calibration.json")
traces=()
for t in "$OUT"/suite/*.arrow ${EXTRA:+$EXTRA/*.arrow}; do [ -f "$t" ] && traces+=(--traces "$t"); done
# shellcheck disable=SC2086
$RUN python3 -m refcheck calibrate --out "$OUT" --no-corpus --device cuda --workers "${WORKERS:-6}" ${CAL_ARGS:-} \
  "${rows[@]}" "${traces[@]}" > "$OUT/table.log" 2>&1
rc=$?
echo "table: rc $rc after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
exit $rc
