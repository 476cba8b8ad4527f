#!/usr/bin/env bash
# The calibration corpus on one GPU in one command: SGLang's configurations (through the offline bundle,
# scripts/sglang_bundle.sh), the reference corpus on the built-in pairs (clean engines in bf16 and fp16,
# every injected fault in bf16, the graded faults in fp16 too) and the same corpus on the wide hybrid
# (trained here from its seed: scripts/train_builtin.py --pairs wide), side by side; then one table of
# everything: OUT/calibration.md and OUT/calibration.json (the SGLang traces diffed against the fp32
# reference on TABLE_DEVICE).
#
#   scripts/calibrate_gpu.sh OUT                              the whole corpus (docs/calibration.md)
#   CONFIGS=none,dflash PARTS=clean scripts/calibrate_gpu.sh OUT  a part of it
#   TABLE=0 scripts/calibrate_gpu.sh OUT                      parts only; the table later, anywhere:
#       scripts/calibrate_gpu.sh --table OUT                  (TABLE_DEVICE=cpu there)
#
# Knobs (environment): CONFIGS (sglang_suite configurations; empty: none), WIDE_CONFIGS (the same on the
# wide pair once it is trained; empty: none), EXTRA (SGLang traces captured earlier, files or directories,
# added to the table), PARTS (of: clean faults
# graded16 wide; default all), PARALLEL engines side by side, MEM (each engine's mem_fraction_static),
# TOKENS per request, PROMPTS per reference run, WORKERS per reference part, LIMIT (seconds for every
# part; each part writes its own table, so a part that overruns costs only itself), MODELS (where the
# wide pair is built), CAL_ARGS (extra refcheck calibrate options for every part, e.g. --bounds ...).
set -uo pipefail
table() {  # one table of every part's rows and every SGLang trace
  local out=$1 rows=() traces=()
  for j in "$out"/*/calibration.json; do [ -f "$j" ] && rows+=(--rows "$j"); done
  local extra=() e
  for e in ${EXTRA:-}; do if [ -d "$e" ]; then extra+=("$e"/*.arrow); else extra+=("$e"); fi; done
  for t in "$out"/suite/*.arrow "$out"/suite-wide/*.arrow "${extra[@]}"; do [ -f "$t" ] && traces+=(--traces "$t"); done
  # shellcheck disable=SC2086
  $RUN python3 -m refcheck calibrate --out "$out" --no-corpus --device "${TABLE_DEVICE:-cuda}" --workers "${WORKERS:-4}" \
    ${CAL_ARGS:-} "${rows[@]}" "${traces[@]}" > "$out/table.log" 2>&1
}
RUN="bash $(dirname "$0")/sglang_bundle.sh run"
if [ "${1:-}" = "--table" ]; then OUT=${2:?usage: calibrate_gpu.sh --table OUT}; RUN=""; table "$OUT"; exit $?; fi
OUT=${1:?usage: scripts/calibrate_gpu.sh OUT}
CONFIGS=${CONFIGS-none,dflash,ngram,ddtree-b8,ddtree-b15,ddtree-b32,ddtree-b64,dflash-graphs,ngram-graphs,ddtree-b15-graphs,ddtree-b64-graphs,ddtree-b15-bs1,ddtree-b15-leaky,ddtree-fault-mamba-flat-index,ddtree-fault-kv-move-last,ddtree-fault-flat-positions,ddtree-fault-bonus-neighbour}
PARTS=${PARTS:-clean faults graded16 wide}
WIDE_CONFIGS=${WIDE_CONFIGS-none,dflash,ngram,ddtree-b15,ddtree-b15-graphs}
LIMIT=${LIMIT:-480} TOKENS=${TOKENS:-32} PROMPTS=${PROMPTS:-2} W=${WORKERS:-4} MODELS=${MODELS:-build/models}
mkdir -p "$OUT"
t0=$(date +%s)
part() {  # NAME ARGS...: one refcheck calibrate corpus under the limit, timed
  local name=$1 left=$(( LIMIT - ($(date +%s) - t0) )); shift
  # shellcheck disable=SC2086
  timeout "$left" $RUN python3 -m refcheck calibrate --out "$OUT/$name" --device cuda --workers "$W" --prompts "$PROMPTS" \
    --max-new-tokens "$TOKENS" --save-traces ${CAL_ARGS:-} "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
}
pids=()
if [ -n "$CONFIGS" ]; then
  (timeout "$LIMIT" $RUN python3 scripts/sglang_suite.py --out "$OUT/suite" --configs "$CONFIGS" --parallel "${PARALLEL:-6}" \
     --stagger "${STAGGER:-8}" --mem-fraction "${MEM:-0.05}" --timeout "$LIMIT" --max-new-tokens "$TOKENS" \
     --no-bf16-replay > "$OUT/suite.log" 2>&1; echo "sglang suite: rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt") &
  pids+=($!)
fi
graded=(--fault rec-scale:0.001 --fault rec-scale:0.01 --fault rec-scale:0.1 --fault conv-noise:0.001 --fault conv-noise:0.01 --fault conv-noise:0.1)
# the wide pair's faults: the commit, position, attention, top-k, walk and draft-context classes, and two sizes of
# each graded fault (its training takes part of the limit)
wide_faults=()
for f in ${WIDE_FAULTS:-sibling-leak state-flat-index conv-not-rolled-back parent-state attention-extra-node deep-positions-plus-one topk-ids-shifted kv-last-unwritten walk-stops-early conv-first-sibling bonus-from-root draft-context-no-root rec-scale:0.01 rec-scale:0.1 conv-noise:0.01 conv-noise:0.1}; do
  wide_faults+=(--fault "$f")
done
for p in $PARTS; do
  case $p in
    clean) part clean --no-faults & pids+=($!) ;;
    faults) part faults --dtype bfloat16 --pair hybrid --budget 15 & pids+=($!) ;;
    graded16) part graded16 --dtype float16 --pair hybrid --budget 15 "${graded[@]}" & pids+=($!) ;;
    wide) (timeout "$LIMIT" $RUN python3 scripts/train_builtin.py --out "$MODELS" --pairs wide --device cuda > "$OUT/wide-train.log" 2>&1
           echo "wide training: rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
           cp "$MODELS/wide/training.json" "$OUT/wide-training.json" 2>/dev/null
           if [ -n "$WIDE_CONFIGS" ]; then  # SGLang on the wide pair, beside its reference corpus
             (left=$(( LIMIT - ($(date +%s) - t0) ))
              timeout "$left" $RUN python3 scripts/sglang_suite.py --out "$OUT/suite-wide" --configs "$WIDE_CONFIGS" \
                --model "$MODELS/wide/target" --draft "$MODELS/wide/draft" --parallel "${PARALLEL:-6}" --stagger "${STAGGER:-8}" \
                --mem-fraction "${MEM:-0.08}" --timeout "$left" --max-new-tokens "$TOKENS" --no-bf16-replay > "$OUT/suite-wide.log" 2>&1
              echo "sglang suite (wide): rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt") &
           fi
           part wide --dtype bfloat16 --dtype float16 --model "$MODELS/wide/target" --draft "$MODELS/wide/draft" --label wide \
             --budget 15 --budget 64 "${wide_faults[@]}"; wait) & pids+=($!) ;;
    *) echo "unknown part $p" >&2; exit 2 ;;
  esac
done
wait "${pids[@]}"
[ "${TABLE:-1}" = 0 ] && exit 0
RUN="timeout ${TABLE_LIMIT:-120} $RUN" table "$OUT"; rc=$?
echo "table: rc $rc after $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
exit $rc
