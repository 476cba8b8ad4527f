#!/bin/bash
# Acceptance, verified, on one GPU: SGLang's drafters captured and diffed, clean and with injected drafter faults.
#
#   scripts/acceptance_runs.sh clean|faults|sampled|none OUT [PARALLEL]
#
# Each run is `refcheck diff --engine sglang` (the built-in hybrid pair, bf16 engine, fp32 reference on the GPU,
# default diff options), several engines side by side on the one GPU (PARALLEL, default 4); OUT/NAME.json is each
# report, OUT/NAME.arrow its trace, OUT/NAME.log its stderr, OUT/summary.tsv one line per run:
#   name  exit  verdict-counts  τ-account  first-failure
# `clean`: DFLASH and REFCHECK_DDTREE (budgets 15 and 32), CUDA graphs off and on, and REFCHECK_DDTREE_SHADOW;
# `faults`: the four REFCHECK_DDTREE drafter faults and the four DFLASH drafter faults (REFCHECK_DRAFT_FAULT);
# `sampled`: REFCHECK_DDTREE budget 15 at T = 1.0 (MAX_NEW 50: 300 emitted tokens), clean and with its sampler
# at 1.1 x and 0.9 x the request's temperature (REFCHECK_DDTREE_FAULT_TEMPERATURE_HIGH / _LOW); `none`: only ALSO's.
# Run it through scripts/sglang_bundle.sh run (SGLang 0.5.17 offline).
set -uo pipefail
kind=${1:?clean|faults|sampled}; out=${2:?OUT}; par=${3:-4}
mkdir -p "$out"
common="--pair hybrid --ref-device cuda --sglang-mem-fraction ${MEM:-0.2} --json"
jobs=()
if [ "$kind" = clean ]; then
  jobs+=("dflash|--sglang-algorithm DFLASH --budget 15"
         "dflash-graphs|--sglang-algorithm DFLASH --budget 15 --cuda-graphs"
         "ddtree-b15|--sglang-algorithm REFCHECK_DDTREE --budget 15"
         "ddtree-b15-graphs|--sglang-algorithm REFCHECK_DDTREE --budget 15 --cuda-graphs"
         "ddtree-b32|--sglang-algorithm REFCHECK_DDTREE --budget 32"
         "ddtree-b32-graphs|--sglang-algorithm REFCHECK_DDTREE --budget 32 --cuda-graphs"
         "shadow-b15|--sglang-algorithm REFCHECK_DDTREE_SHADOW --budget 15")
elif [ "$kind" = sampled ]; then
  t1="--temperature 1.0 --max-new-tokens ${MAX_NEW:-50}"
  jobs+=("ddtree-b15-t1|--sglang-algorithm REFCHECK_DDTREE --budget 15 $t1"
         "ddtree-fault-temperature_high-t1|--sglang-algorithm REFCHECK_DDTREE_FAULT_TEMPERATURE_HIGH --budget 15 $t1"
         "ddtree-fault-temperature_low-t1|--sglang-algorithm REFCHECK_DDTREE_FAULT_TEMPERATURE_LOW --budget 15 $t1")
elif [ "$kind" = faults ]; then
  for f in POSITIONS_SHIFTED SKIP_LAST WRONG_LAYERS DEPTH_SHIFT; do
    jobs+=("ddtree-fault-${f,,}|--sglang-algorithm REFCHECK_DDTREE_FAULT_DRAFT_$f --budget 15")
  done
  for f in context-positions-shifted context-skip-last context-layers-swapped draft-depth-shift; do
    jobs+=("dflash-fault-$f|--sglang-algorithm DFLASH --budget 15|$f")
  done
elif [ "$kind" != none ]; then
  echo "acceptance_runs.sh: unknown kind '$kind' (clean, faults, sampled, or none with ALSO)" >&2; exit 2
fi
# runs to add, by name: dflash, ddtree-b32, ddtree-b32-graphs, dflash-fault-<REFCHECK_DRAFT_FAULT name>
[ -n "${ALSO:-}" ] && for a in $ALSO; do
  case $a in dflash) jobs+=("dflash|--sglang-algorithm DFLASH --budget 15");;
             ddtree-b32) jobs+=("ddtree-b32|--sglang-algorithm REFCHECK_DDTREE --budget 32");;
             ddtree-b32-graphs) jobs+=("ddtree-b32-graphs|--sglang-algorithm REFCHECK_DDTREE --budget 32 --cuda-graphs");;
             ddtree-b15-t1) jobs+=("ddtree-b15-t1|--sglang-algorithm REFCHECK_DDTREE --budget 15 --temperature 1.0 --max-new-tokens 50");;
             dflash-fault-*) jobs+=("$a|--sglang-algorithm DFLASH --budget 15|${a#dflash-fault-}");; esac
done
one() {
  IFS='|' read -r name args fault <<<"$1"
  case $args in *--max-new-tokens*) ;; *) args="$args --max-new-tokens ${MAX_NEW:-32}";; esac
  env ${fault:+REFCHECK_DRAFT_FAULT=$fault} timeout "${JOB_TIMEOUT:-280}" python3 -m refcheck diff --engine sglang $args \
    $common --save-trace "$out/$name.arrow" >"$out/$name.json" 2>"$out/$name.log"
  echo "$name $?" >>"$out/exit.txt"
}
export -f one; export out common
printf '%s\n' "${jobs[@]}" | xargs -P "$par" -I{} bash -c 'one "$@"' _ {}
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
codes = dict(l.split() for l in (out / "exit.txt").read_text().splitlines())
rows = []
for name in sorted(codes):
    try:
        r = json.loads((out / f"{name}.json").read_text())["reports"][0]
    except Exception as exc:
        rows.append(f"{name}\t{codes[name]}\t-\t-\tno report ({type(exc).__name__})")
        continue
    acc = r["stats"].get("acceptance_account") or {}
    first = next((f for f in r["findings"] if f["verdict"] == "fail"), None)
    unsup = sum(1 for f in r["findings"] if f["verdict"] == "unsupported" and f["category"] == "draft")
    rows.append("\t".join([name, codes[name], json.dumps(r["counts"]), json.dumps(
        {k: acc.get(k) for k in ("rule", "steps", "tau_engine", "tau_reference", "by_cause", "unrecorded_steps")}),
        f"draft checks {r['checks'].get('draft', 0)}, draft unsupported {unsup}, tree checks {r['checks'].get('tree', 0)}",
        json.dumps(r['stats'].get('shadow')), json.dumps(r['stats'].get('temperature')),
        f"{first['category']} step {first['step']} {first['request_id']}: {first['message'][:160]}" if first else "-"]))
(out / "summary.tsv").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
