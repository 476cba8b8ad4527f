#!/usr/bin/env python
"""One SGLang settings-matrix table from several runs: later runs' cells replace earlier ones.

    python scripts/matrix_table.py OUT_DIR RUN1.json RUN2.json ... [--rejudged DIR]

Each RUN is a ``refcheck matrix`` result (matrix.json or matrix.partial.json). A cell takes its row from
the latest run that *ran* it; a cell no run ran keeps the latest reason it could not run, and a cell of
``refcheck matrix``'s algorithms x settings that no run lists is a row saying so. Each row says
which run it came from (``from``). ``--rejudged DIR`` adds, per cell, the verdict of a later replay of its
saved trace (``DIR/*CELL.json``: ``refcheck diff --against TRACE --mode replay --json`` output), e.g. under
a verdict that changed since the GPU judged it. Writes OUT_DIR/matrix.json and OUT_DIR/matrix.md (the table
of ``refcheck.sglang.matrix.markdown``, with the re-judged column appended where given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refcheck.atomic_file import atomic_write_bytes  # noqa: E402
from refcheck.sglang.matrix import ALGORITHMS, SETTINGS, markdown  # noqa: E402


def merge(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The cells of every run, the latest run of a cell winning over earlier ones, a run over a 'not run'."""
    rows: dict[str, dict[str, Any]] = {}
    for label, result in runs:
        for r in result.get("rows", []):
            if "cell" not in r:  # a capture-off twin's raw record in a partial file
                continue
            old = rows.get(r["cell"])
            if old is None or r["status"] == "run" or old["status"] != "run":
                rows[r["cell"]] = {**r, "from": label}
    for setting in SETTINGS:  # every cell of the matrix is in the table: one no run reached says so
        for alg in ALGORITHMS:
            rows.setdefault(f"{alg}-{setting}", {"cell": f"{alg}-{setting}", "algorithm": alg, "setting": setting,
                                                 "status": "not run", "reason": "in none of the runs merged here"})
    last = runs[-1][1] if runs else {}
    return {"runs": [label for label, _ in runs], "rows": list(rows.values()),
            "not_runnable_algorithms": last.get("not_runnable_algorithms", {})}


def rejudged(directory: Path, cells: list[str]) -> dict[str, str]:
    """cell -> 'verdict (pass/benign/triaged/fail)' of its re-judged report, for the cells found in ``directory``."""
    out = {}
    for cell in cells:
        hits = sorted(directory.glob(f"*{cell}.json"))
        for path in hits[-1:]:
            try:
                rep = json.loads(path.read_text())["reports"][0]
            except (ValueError, KeyError, IndexError):
                continue
            c = rep["counts"]
            out[cell] = f"{rep['verdict']} ({c['pass']}/{c['benign_tie']}/{c['triaged']}/{c['fail']})"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--rejudged", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append((str(path), json.loads(path.read_text())))
        except (OSError, ValueError) as exc:
            print(f"matrix_table: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    result = merge(runs)
    md = markdown(result)
    if args.rejudged is not None:
        again = rejudged(args.rejudged, [r["cell"] for r in result["rows"]])
        for r in result["rows"]:
            if r["cell"] in again:
                r["rejudged"] = again[r["cell"]]
                if r["status"] != "run":  # captured, its diff cut short: the trace was diffed elsewhere
                    r["reason"] = f"captured on the GPU, not diffed there; its trace diffed later: {again[r['cell']]}"
        md = markdown(result)
        md += "\nRe-judged on CPU (verdict (pass/benign/triaged/fail)):\n\n" + "\n".join(
            f"- {cell}: {v}" for cell, v in again.items()) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out / "matrix.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(args.out / "matrix.md", md.encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
