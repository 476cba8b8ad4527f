"""Published baselines for DFlash / DDTree acceptance length and speedup.

Contract
========

Data
----
One CSV per public source lives in ``refcheck/baselines/data/`` (see ``README.md`` next to this
file for columns and provenance). Every figure is transcribed from the public source that README names
(the DDTree paper's tables and figures, z-lab/dflash's README); none is invented. The CSV *stem* is the baseline ``name``:

* ``ddtree_table1``       DDTree paper Table 1 (DFlash chain vs DDTree best budget, 10 datasets,
                          3 targets, T=0 and T=1).
* ``ddtree_budget_sweep`` DDTree paper Fig. 3 (MATH-500, Qwen3-8B, T=0; tau and speedup per budget).
* ``ddtree_accept_hist``  DDTree paper Fig. 4 acceptance-length histograms (one row per histogram;
                          the CSV is long format, one line per bin).
* ``dflash_readme``       z-lab/dflash README table (B200, block 16, DFlash chain only).

tau convention: mean acceptance length per verify round with the bonus token INCLUDED, so
``1 <= tau <= block_size``. Every source in baselines.md already reports it that way, so
``extra["tau_converted_from"]`` is empty for them; the one derived value is the histogram mean
(``ddtree_accept_hist``), flagged there as ``"histogram mean (computed by the loader)"``.

API
---
``BaselineRow``: one published condition. ``budget`` is ``None`` for DFlash chain rows and for
DDTree rows whose source reports only "the best budget" (Table 1); ``speedup`` is ``None`` when
the source gives none. ``extra`` holds every other column of the CSV that is non-empty
(hardware, notes, n_prompts, ...) plus ``"file"`` (the CSV stem); for histogram rows also
``"histogram"`` (fractions for tau = 1..block_size). ``extra`` is excluded from hashing.

``load_baselines(name=None)``: rows of one CSV (``name`` = stem, a trailing ``.csv`` is tolerated)
or of all CSVs (``None``), in file order. Unknown name -> :class:`BaselineError` (a
:class:`refcheck.errors.UsageError`, exit code 2) whose message lists the known names. A
malformed data file is a packaging bug and raises ``ValueError`` naming file and line.

``match(rows, *, model, dataset, temperature, method, budget)``: rows meeting every given
criterion (``None`` = any). ``model``, ``dataset`` and ``method`` compare case-insensitively but
otherwise exactly (``"AIME24"`` does not match ``"AIME 2024"``); ``temperature`` compares as a float
(|diff| < 1e-9); ``budget`` compares as an int (a row with ``budget=None`` never matches a given
budget). No match -> :class:`NoMatchingBaseline` (a ``UsageError``) whose message names the
criteria that match no row at all (with close spellings) and lists the nearest available
conditions (fewest differing criteria).

Statistics on measured acceptance lengths are in :mod:`refcheck.baselines.stats`.
"""

from __future__ import annotations

import csv
import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources

from refcheck.errors import UsageError

__all__ = [
    "BaselineError",
    "BaselineRow",
    "NoMatchingBaseline",
    "baseline_names",
    "load_baselines",
    "match",
]

CORE_COLUMNS = (
    "source", "model", "drafter", "dataset", "temperature", "method", "budget", "speedup", "tau",
    "block_size",
)
_INT_EXTRAS = ("n_prompts", "max_new_tokens")
_HIST_STEM = "ddtree_accept_hist"
_METHODS = ("dflash", "ddtree")


class BaselineError(UsageError):
    """Unknown baseline name (or another user error about baselines)."""


class NoMatchingBaseline(UsageError):
    """No published baseline row has the requested conditions."""


@dataclass(frozen=True, slots=True)
class BaselineRow:
    source: str
    model: str
    drafter: str
    dataset: str
    temperature: float
    method: str
    budget: int | None
    tau: float
    speedup: float | None
    block_size: int
    extra: dict = field(default_factory=dict, hash=False)

    def conditions(self) -> str:
        budget = "-" if self.budget is None else str(self.budget)
        return (f"model={self.model} dataset={self.dataset} temperature={self.temperature:g} "
                f"method={self.method} budget={budget}")


def _data_dir():
    return resources.files(__name__).joinpath("data")


def baseline_names() -> list[str]:
    """Stems of the bundled CSV files, sorted."""
    return sorted(p.name[:-4] for p in _data_dir().iterdir() if p.name.endswith(".csv"))


def load_baselines(name: str | None = None) -> list[BaselineRow]:
    names = baseline_names()
    if name is None:
        return [row for n in names for row in _load_file(n)]
    stem = name[:-4] if name.endswith(".csv") else name
    if stem not in names:
        close = difflib.get_close_matches(stem, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BaselineError(
            f"unknown baseline {name!r}{hint}; known baselines: {', '.join(names)}")
    return _load_file(stem)


def _read_csv(stem: str) -> list[tuple[int, dict[str, str]]]:
    text = _data_dir().joinpath(stem + ".csv").read_text(encoding="utf-8")
    reader = csv.DictReader(text.splitlines())
    return [(i, rec) for i, rec in enumerate(reader, start=2)]


def _bad(stem: str, line: int, msg: str) -> ValueError:
    return ValueError(f"baselines data {stem}.csv line {line}: {msg}")


def _opt_int(s: str) -> int | None:
    return int(s) if s.strip() else None


def _opt_float(s: str) -> float | None:
    return float(s) if s.strip() else None


def _common(stem: str, line: int, rec: dict[str, str]) -> dict:
    try:
        out = dict(
            source=rec["source"], model=rec["model"], drafter=rec["drafter"],
            dataset=rec["dataset"], temperature=float(rec["temperature"]),
            method=rec["method"].strip().lower(), budget=_opt_int(rec["budget"]),
            block_size=int(rec["block_size"]),
        )
    except (KeyError, ValueError) as exc:
        raise _bad(stem, line, f"bad or missing column ({exc})") from None
    if out["method"] not in _METHODS:
        raise _bad(stem, line, f"method {out['method']!r} not in {_METHODS}")
    if out["block_size"] < 1:
        raise _bad(stem, line, "block_size < 1")
    return out


def _extras(stem: str, rec: dict[str, str], skip: Iterable[str]) -> dict:
    skip = set(skip)
    extra: dict = {"file": stem}
    for k, v in rec.items():
        if k in skip or v is None or not v.strip():
            continue
        extra[k] = int(v) if k in _INT_EXTRAS else v
    return extra


def _check_tau(stem: str, line: int, tau: float, block_size: int) -> None:
    if not (1.0 <= tau <= block_size) or math.isnan(tau):
        raise _bad(stem, line, f"tau {tau} outside [1, block_size={block_size}]")


def _load_file(stem: str) -> list[BaselineRow]:
    if stem == _HIST_STEM:
        return _load_hist(stem)
    rows = []
    for line, rec in _read_csv(stem):
        common = _common(stem, line, rec)
        try:
            tau = float(rec["tau"])
            speedup = _opt_float(rec["speedup"])
        except (KeyError, ValueError) as exc:
            raise _bad(stem, line, f"bad tau/speedup ({exc})") from None
        _check_tau(stem, line, tau, common["block_size"])
        rows.append(BaselineRow(**common, tau=tau, speedup=speedup,
                                extra=_extras(stem, rec, CORE_COLUMNS)))
    return rows


def _load_hist(stem: str) -> list[BaselineRow]:
    """Group the long-format histogram CSV into one row per histogram (per condition)."""
    groups: dict[tuple, dict] = {}
    group_cols = None
    for line, rec in _read_csv(stem):
        if group_cols is None:
            group_cols = [c for c in rec if c not in ("tau_bin", "fraction")]
        key = tuple(rec[c] for c in group_cols)
        g = groups.setdefault(key, {"line": line, "rec": rec, "bins": {}})
        try:
            b, frac = int(rec["tau_bin"]), float(rec["fraction"])
        except (KeyError, ValueError) as exc:
            raise _bad(stem, line, f"bad tau_bin/fraction ({exc})") from None
        if b in g["bins"] or frac < 0:
            raise _bad(stem, line, f"duplicate bin {b} or negative fraction")
        g["bins"][b] = frac
    rows = []
    for g in groups.values():
        line, rec = g["line"], g["rec"]
        common = _common(stem, line, rec)
        bs = common["block_size"]
        if sorted(g["bins"]) != list(range(1, bs + 1)):
            raise _bad(stem, line, f"histogram bins {sorted(g['bins'])} are not 1..{bs}")
        hist = [g["bins"][b] for b in range(1, bs + 1)]
        total = sum(hist)
        if not 0.98 <= total <= 1.02:
            raise _bad(stem, line, f"histogram sums to {total}, not ~1")
        tau = sum(b * f for b, f in zip(range(1, bs + 1), hist)) / total
        _check_tau(stem, line, tau, bs)
        extra = _extras(stem, rec, (*CORE_COLUMNS, "tau_bin", "fraction"))
        extra["histogram"] = hist
        extra["tau_converted_from"] = "histogram mean (computed by the loader)"
        rows.append(BaselineRow(**common, tau=tau, speedup=None, extra=extra))
    return rows


# --------------------------------------------------------------------------------------------
# matching

def _norm(s: str) -> str:
    return s.strip().casefold()


def _criteria(model, dataset, temperature, method, budget) -> dict:
    return {k: v for k, v in dict(model=model, dataset=dataset, temperature=temperature,
                                  method=method, budget=budget).items() if v is not None}


def _field_matches(row: BaselineRow, key: str, want) -> bool:
    have = getattr(row, key)
    if key in ("model", "dataset", "method"):
        return _norm(have) == _norm(str(want))
    if key == "temperature":
        return math.isclose(have, float(want), rel_tol=0.0, abs_tol=1e-9)
    if key == "budget":
        return have is not None and have == int(want)
    raise AssertionError(key)


def _closeness(row: BaselineRow, key: str, want) -> float:
    """0 (identical) .. 1 (unrelated): tie-break among rows with the same mismatch count."""
    have = getattr(row, key)
    if key in ("model", "dataset", "method"):
        return 1.0 - difflib.SequenceMatcher(None, _norm(have), _norm(str(want))).ratio()
    if have is None:
        return 1.0
    a, b = float(have), float(want)
    return min(1.0, abs(a - b) / (abs(a) + abs(b) + 1e-9))


def match(rows: list[BaselineRow], *, model: str | None = None, dataset: str | None = None,
          temperature: float | None = None, method: str | None = None,
          budget: int | None = None) -> list[BaselineRow]:
    crit = _criteria(model, dataset, temperature, method, budget)
    rows = list(rows)
    found = [r for r in rows if all(_field_matches(r, k, v) for k, v in crit.items())]
    if found:
        return found
    raise NoMatchingBaseline(_no_match_message(rows, crit))


def _absent_why(rows: list[BaselineRow], key: str) -> str:
    """Why no row has ``key``: for budgets, that the source reports the best of several (which ones),
    and where per-budget rows are."""
    if key != "budget":
        return f"no row of this source gives a {key}"
    cands = sorted({r.extra["budget_candidates"] for r in rows if r.extra.get("budget_candidates")})
    per_budget = sorted({r.budget for r in load_baselines() if r.budget is not None and "histogram" not in r.extra})
    text = "these rows give no budget"
    if cands:
        text += f" (DDTree rows report the best of budgets {cands[0].replace(';', ', ')})"
    return (text + "; leave out --budget to compare with them, or use --source ddtree_budget_sweep (per-budget rows: "
            + ", ".join(map(str, per_budget)) + ")")


def _no_match_message(rows: list[BaselineRow], crit: dict) -> str:
    want = ", ".join(f"{k}={v!r}" for k, v in crit.items()) or "(no criteria)"
    if not rows:
        return f"no baseline matches {want}: the row list is empty"
    lines = [f"no baseline matches {want} among {len(rows)} rows."]
    for k, v in crit.items():
        if any(_field_matches(r, k, v) for r in rows):
            continue
        avail = sorted({str(getattr(r, k)) for r in rows if getattr(r, k) is not None},
                       key=lambda s: (len(s), s))
        close = difflib.get_close_matches(str(v), avail, n=3, cutoff=0.5) if k in (
            "model", "dataset", "method") else []
        if k in ("model", "dataset", "method"):
            close += [a for a in avail if _norm(str(v)) in _norm(a) and a not in close][:3]
        if not avail:  # no row gives this field at all: say so, and what the rows give instead
            lines.append(f"  {k}={v!r} matches no row: {_absent_why(rows, k)}")
            continue
        shown = close or avail[:12]
        label = "did you mean" if close else "available"
        more = "" if close or len(avail) <= 12 else f" (+{len(avail) - 12} more)"
        lines.append(f"  {k}={v!r} matches no row; {label}: {', '.join(shown)}{more}")
    scored: dict[tuple, tuple] = {}
    for r in rows:
        diff = [k for k, v in crit.items() if not _field_matches(r, k, v)]
        score = (len(diff), sum(_closeness(r, k, crit[k]) for k in diff))
        key = (r.extra.get("file", ""), r.conditions())
        if key not in scored or score < scored[key][0]:
            scored[key] = (score, diff)
    best = sorted(scored.items(), key=lambda kv: (kv[1][0], kv[0]))[:8]
    n_min = best[0][1][0][0]
    lines.append(f"  nearest available conditions ({n_min} of {len(crit)} criteria differ):")
    for (stem, cond), (_, diff) in best:
        lines.append(f"    [{stem}] {cond}  (differs in: {', '.join(diff)})")
    return "\n".join(lines)
