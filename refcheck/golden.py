"""Golden traces: the built-in cases, regeneration with review, verification and the CI gate.

Contract:

* ``golden/`` holds one trace per case (``<case>.arrow``) and ``MANIFEST.json`` (sha256, bytes,
  provenance summary, history of replacements with reasons).
* :func:`regenerate` re-runs the reference for each case and prints a review summary against the
  stored golden (first divergent token per prompt, τ deltas, what in the provenance changed).
  Before any decoding it refuses (UsageError, exit 2) a case named twice, an unknown case, a blank
  reason and a golden directory a writer cannot use (``store.check_writable``: missing with its
  parent, read-only, full, not a directory). Without ``accept`` it writes ``<case>.arrow.pending``
  beside the golden and the old golden stays untouched; with ``accept`` (and a reason, when a golden
  is replaced) it replaces every case in one locked, crash-safe transaction of
  :mod:`refcheck.trace.store` (all cases or none) and records old -> new provenance and the reason; a
  case another writer replaced, added or removed while it decoded is refused (GoldenError, nothing
  written). :func:`add_trace` and :func:`remove_case` go through the same store and need a non-blank
  reason; case names are plain names (``store.check_case_name``).
* :func:`gate` verifies hashes (missing -> exit 3, mismatch -> exit 4), refuses stale goldens
  (model/draft/tokenizer/budget/prompt-set changed -> exit 3), diffs every case in replay and
  free-run mode against the live reference and is strict about skips: an unsupported or skipped
  check fails the case unless the manifest allows it. A case may expect a failure (a stored trace
  of a known-buggy engine): it then passes only if refcheck finds that failure. Cases go over one
  process per usable core by default (:func:`gate_jobs`: cases that share work together, costliest
  first); ``profiles`` collects each case's :class:`refcheck.profile.Profile`; ``cache_dir`` reuses
  reports whose key (:mod:`refcheck.gate_cache`) is unchanged. None of these changes a verdict.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from refcheck.budget import budget_tag
from refcheck.diff.findings import Report, check_category
from refcheck.diff.place import where
from refcheck.diff.session import DiffSession, reference_spec_for
from refcheck.drift import Drift, numeric_drift, version_changes
from refcheck.errors import CorruptTraceError, GoldenError, RefcheckError, UsageError
from refcheck.gate_policy import GatePolicy, describe_expect, parse_expect_first, parse_triage
from refcheck.profile import Profile, count, phase
from refcheck.progress import Progress, tell
from refcheck.prompts import load_prompts
from refcheck.provenance import dir_sha256, stale_reasons
from refcheck.reference_runner import EngineSpec
from refcheck.trace import store
from refcheck.trace.io import Trace, atomic_write_bytes, read_trace, trace_bytes, trace_from_bytes
from refcheck.trace.manifest import Manifest, load_manifest, shown

REPO_GOLDEN = Path(__file__).resolve().parents[1] / "golden"
PENDING_SUFFIX = ".pending"


def default_golden_dir() -> Path:
    return REPO_GOLDEN if REPO_GOLDEN.is_dir() else Path.cwd() / "golden"


@dataclass(frozen=True, slots=True)
class GoldenCase:
    name: str
    pair: str
    budget: int | None  # None = chain mode
    drafter: str = "dflash"
    max_new_tokens: int = 32

    def spec(self) -> EngineSpec:
        return EngineSpec(pair=self.pair, budget=self.budget, drafter=self.drafter, max_new_tokens=self.max_new_tokens)


#: the reference goldens: both built-in pairs at budgets 1, 15, 64 and chain (fp32, CPU), plus the
#: scripted drafter on the hybrid pair so the gate also covers deep accepted paths through siblings
GOLDEN_CASES: dict[str, GoldenCase] = {
    c.name: c
    for c in [GoldenCase(f"{pair}-{budget_tag(b)}", pair, b) for pair in ("hybrid", "attention") for b in (1, 15, 64, None)]
    + [GoldenCase("hybrid-b15-scripted", "hybrid", 15, drafter="scripted")]
}


def _summary(prov: dict) -> dict:
    """The provenance kept in the manifest (enough to review a replacement)."""
    keys = ("engine", "model", "model_sha256", "draft_sha256", "tokenizer_sha256", "dtype", "device", "budget",
            "block_size", "max_new_tokens", "drafter", "prompt_set_sha256", "versions", "created", "case", "expect",
            "allow_unsupported", "triaged", "triage_rules", "expect_first")
    return {k: prov[k] for k in keys if k in prov}


# -- review -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Review:
    """One case's regeneration against its stored golden. ``status``: "new"; "unchanged" (same tokens,
    acceptance, numbers and library versions); "drifted" (same tokens and acceptance, but numbers or
    recorded library versions differ: the bytes change); "changed" (tokens, acceptance or the stale-
    making provenance differ); "old unreadable"."""

    case: str
    status: str
    provenance_changes: list[str] = field(default_factory=list)
    first_divergence: dict[str, int] = field(default_factory=dict)  # request -> first differing output index
    tau_old: float | None = None
    tau_new: float | None = None
    written: str = ""
    version_changes: list[str] = field(default_factory=list)  # "transformers 5.23.0 → 5.24.0"
    drift: Drift | None = None  # numbers where old and new describe the same step

    def to_json(self) -> dict:
        return {"case": self.case, "status": self.status, "provenance_changes": self.provenance_changes,
                "first_divergence": self.first_divergence, "tau_old": self.tau_old, "tau_new": self.tau_new,
                "written": self.written, "version_changes": self.version_changes,
                "numeric_drift": self.drift.to_json() if self.drift else None}


def _mean_tau(trace: Trace) -> float | None:
    taus = [s.accept_length for s in trace.steps]
    return statistics.fmean(taus) if taus else None


def review(case: str, old: Trace | None, new: Trace) -> Review:
    rev = Review(case, "new", tau_new=_mean_tau(new))
    if old is None:
        return rev
    rev.tau_old = _mean_tau(old)
    rev.provenance_changes = stale_reasons(old.provenance, new.provenance)
    old_out = {r.request_id: r.output_ids for r in old.requests}
    for r in new.requests:
        prev = old_out.get(r.request_id)
        if prev is None:
            rev.first_divergence[r.request_id] = 0
            continue
        i = next((j for j, (a, b) in enumerate(zip(prev, r.output_ids)) if a != b), None)
        if i is None and len(prev) != len(r.output_ids):
            i = min(len(prev), len(r.output_ids))
        if i is not None:
            rev.first_divergence[r.request_id] = i
    old_steps = [(s.request_id, s.step, s.accept_length, s.accepted) for s in old.steps]
    new_steps = [(s.request_id, s.step, s.accept_length, s.accepted) for s in new.steps]
    rev.version_changes = version_changes(old.provenance, new.provenance)
    rev.drift = numeric_drift(old, new)
    same = not rev.first_divergence and old_steps == new_steps and not rev.provenance_changes
    rev.status = "changed" if not same else ("drifted" if rev.version_changes or rev.drift.any else "unchanged")
    return rev


# -- regeneration ------------------------------------------------------------------------------------
def _regen_names(golden_dir: Path, case_names: list[str] | None, reason: str | None) -> list[str]:
    """The cases to regenerate, refused up front (UsageError) when one is named twice, is not a built-in
    reference case, or the reason given is blank."""
    names = case_names or list(GOLDEN_CASES)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--case {shown(twice[0])} is given more than once; name each case once")
    if reason is not None and not reason.strip():
        raise UsageError("--reason is empty: say why the goldens change (recorded in MANIFEST.json)")
    unknown = [n for n in names if n not in GOLDEN_CASES]
    if unknown:
        stored = set(load_manifest(golden_dir, allow_missing=True).cases)
        engine = [n for n in unknown if n in stored]
        if engine:
            raise UsageError(f"golden case(s) {engine} hold another engine's trace (or one of your own model), which regen "
                             "cannot re-run: regen re-runs only the built-in reference cases. Record them again with "
                             "their engine (SGLang: scripts/sglang_suite.py on a GPU; your model: refcheck diff --engine "
                             "reference --model DIR --draft DIR --prompts FILE --save-trace TRACE) and replace them with "
                             "refcheck golden add TRACE --case NAME --reason ...")
        raise UsageError(f"unknown golden case(s) {unknown} (known: {', '.join(GOLDEN_CASES)})")
    return names


def _stored_golden(path: Path) -> tuple[Trace | None, bool]:
    """(the golden at ``path`` or None, whether a file is there at all)."""
    if not path.is_file():
        return None, False
    try:
        return read_trace(path), True
    except CorruptTraceError:
        return None, True


def _write_pending(path: Path, data: bytes) -> Path:
    pending = path.with_name(path.name + PENDING_SUFFIX)
    try:
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(pending, data)
    except OSError as exc:
        raise UsageError(f"cannot write {pending}: {exc.strerror or exc}; the goldens are unchanged") from None
    return pending


def regenerate(
    golden_dir: Path,
    case_names: list[str] | None,
    reason: str | None,
    accept: bool,
    session: DiffSession,
    progress: Progress | None = None,
) -> list[Review]:
    """Re-run the reference for each case and review it against the stored golden (module docstring).
    The cases, the reason and the golden directory are checked before any decoding; with ``accept`` each
    case is written only if no other writer changed or removed it since this regeneration read the store."""
    golden_dir = Path(golden_dir)
    names = _regen_names(golden_dir, case_names, reason)
    store.check_writable(golden_dir)  # before minutes of decoding, not after
    with store.reading(golden_dir):
        seen = load_manifest(golden_dir, allow_missing=True).cases
    prompts = load_prompts()
    reviews: list[Review] = []
    writes: list[store.Write] = []
    for name in names:
        tell(progress, f"regen: {name}")
        trace, _ = session.runner(GOLDEN_CASES[name].spec()).trace(prompts)
        trace.provenance["case"] = name
        data = trace_bytes(trace)
        path = golden_dir / f"{name}.arrow"
        old, present = _stored_golden(path)
        rev = review(name, old, trace)
        if present and old is None:
            rev.status = "old unreadable"
        if accept:
            if old is not None and rev.status != "unchanged" and not reason:
                raise UsageError(f"golden {name} changes: give --reason for the record (nothing was written)")
            base = seen[name].sha256 if name in seen else None
            writes.append(store.Write(name, data, _summary(trace.provenance), reason, expect_base=True, base=base))
            rev.written = str(path)
        else:
            rev.written = str(_write_pending(path, data))
        reviews.append(rev)
    if writes:
        store.commit(golden_dir, writes)  # every case or none, whatever instant the process dies
    return reviews


def add_trace(golden_dir: Path, trace_path: Path, case: str, expect: str, allow_unsupported: list[str],
              reason: str, triage: list[str] | None = None, session: DiffSession | None = None,
              expect_first: str | None = None) -> Path:
    """Store an engine trace as a golden case (atomic; an existing case is replaced only with history).
    ``triage``: findings a person reviewed (REQUEST:STEP:NODE:CATEGORY), reported as TRIAGED by the gate.
    The trace is first put through the gate's own check with these settings: a trace that would fail
    the gate the moment it lands (``--expect pass`` with failures, an expected failure not caught, or
    stale models) is refused with the first failing findings, and nothing is written."""
    _need_reason("add", reason)
    store.check_case_name(case)
    if expect != "pass" and not expect.startswith("fail"):
        raise UsageError(f"--expect must be 'pass', 'fail' or 'fail:CATEGORY', got {expect!r}")
    if expect.startswith("fail:"):
        check_category(expect.split(":", 1)[1], f"--expect {expect}")
    for cat in allow_unsupported:
        check_category(cat, "--allow-unsupported")
    triaged = parse_triage(triage or [])
    first = parse_expect_first(expect_first)
    if first is not None and expect == "pass":
        raise UsageError("--expect-first is where an expected failure must first show: it needs --expect fail[:CATEGORY]")
    if case in GOLDEN_CASES:
        raise UsageError(f"{case!r} is a built-in reference case; choose another name")
    store.check_writable(Path(golden_dir))
    with store.reading(Path(golden_dir)):
        load_manifest(Path(golden_dir), allow_missing=True)  # a broken store is refused before the gate's check
    try:
        data = Path(trace_path).read_bytes()  # the bytes checked are the bytes stored
    except OSError:
        read_trace(Path(trace_path))  # raises the typed error for a missing or unreadable trace
        raise
    trace = trace_from_bytes(data, str(trace_path))
    summary = {**_summary(trace.provenance), "expect": expect, "allow_unsupported": allow_unsupported,
               "triaged": triaged, **({"expect_first": first} if first else {})}
    report = check_trace(case, trace, summary, session or DiffSession())
    if report.verdict not in ("pass", "expected failure caught"):
        fails = [f for f in report.failures][:3]
        raise GoldenError(
            f"{trace_path} would fail the gate as {case!r} ({report.verdict}: {report.counts.get('fail', 0)} failing "
            f"checks; first: " + "; ".join(f"{where(f)}: {f.message[:120]}"
                                          for f in fails)
            + "). Review them, then add --triage REQUEST:STEP:NODE:CATEGORY for reviewed findings, "
              "--allow-unsupported CATEGORY for what the engine cannot record, or --expect fail:CATEGORY for a "
              "known-buggy engine; nothing was written")
    store.commit(Path(golden_dir), [store.Write(case, data, summary, reason)])
    return Path(golden_dir) / store.trace_file_name(case)


def _need_reason(command: str, reason: str | None) -> None:
    if not reason or not reason.strip():
        raise UsageError(f"golden {command} needs --reason (recorded in MANIFEST.json)")


def remove_case(golden_dir: Path, case: str, reason: str) -> Manifest:
    """Remove a golden case (its entry moves to the manifest's ``removed`` list with the reason;
    its file is deleted), in one store transaction."""
    _need_reason("remove", reason)
    return store.commit(Path(golden_dir), removes=[store.Remove(store.check_case_name(case), reason)])


# -- verification and the gate ------------------------------------------------------------------------
def verify(golden_dir: Path, case: str | None = None) -> Manifest:
    """Hash check of every golden (or of ``case`` alone, as a manifest of that one entry): GoldenError for missing
    files, CorruptTraceError for mismatches. A golden change interrupted after its commit point is completed first
    (``store.recover``)."""
    with store.reading(Path(golden_dir)):
        manifest = load_manifest(Path(golden_dir))
        if case is not None:
            if case not in manifest.cases:
                raise GoldenError(f"no golden trace for case(s) {[case]} in {golden_dir}")
            manifest = Manifest(cases={case: manifest.cases[case]})
        problems = manifest.verify(Path(golden_dir))
    if not manifest.cases:
        raise GoldenError(f"{golden_dir}: the manifest lists no golden traces (run: refcheck golden regen --accept)")
    missing = [p for p in problems if p.endswith(" is missing")]
    if missing:
        raise GoldenError("missing golden trace(s): " + "; ".join(missing))
    if problems:
        raise CorruptTraceError("golden trace(s) do not match MANIFEST.json: " + "; ".join(problems))
    return manifest


def live_provenance_reasons(trace: Trace, session: DiffSession) -> list[str]:
    """Why a stored trace does not match the current models and prompts it names (empty = fresh)."""
    prov = trace.prov
    case = GOLDEN_CASES.get(prov.case or "")
    if prov.is_reference and case is not None:
        live = session.runner(case.spec()).provenance(load_prompts())
        return stale_reasons(trace.provenance, live)
    reasons: list[str] = []
    tdir, ddir = reference_spec_for(trace).resolved_dirs()
    if prov.model_sha256 and dir_sha256(tdir) != prov.model_sha256:
        reasons.append(f"model_sha256: {prov.model} changed since the trace was recorded")
    if prov.draft_sha256 and ddir is not None and dir_sha256(ddir) != prov.draft_sha256:
        reasons.append("draft_sha256: the draft checkpoint changed since the trace was recorded")
    return reasons


def gate_case(name: str, entry, golden_dir: Path, session: DiffSession) -> Report:
    with phase("load_trace"):
        trace = read_trace(Path(golden_dir) / entry.file)
    return check_trace(name, trace, entry.provenance, session)


def cached_gate_case(name: str, entry, golden_dir: Path, session: DiffSession, cache=None) -> Report:
    """:func:`gate_case` through ``cache`` (a :class:`refcheck.gate_cache.ReportCache`, or None)."""
    if cache is None:
        return gate_case(name, entry, golden_dir, session)
    with phase("cache"):
        report = cache.get(entry)
    if report is not None:
        count("cache_hits")
        return report
    report = gate_case(name, entry, golden_dir, session)
    with phase("cache"):
        cache.put(entry, report)
    return report


def profiled_gate_case(name: str, entry, golden_dir: Path, session: DiffSession,
                       profiles: dict[str, Profile] | None, cache=None) -> Report:
    """:func:`cached_gate_case`, under a fresh profile stored in ``profiles[name]`` when ``profiles`` is given."""
    if profiles is None:
        return cached_gate_case(name, entry, golden_dir, session, cache)
    prof = profiles[name] = Profile()
    with prof.active(), phase("gate.other"):
        return cached_gate_case(name, entry, golden_dir, session, cache)


def check_trace(name: str, trace: Trace, settings: dict, session: DiffSession, mode: str = "both",
                ref_dtype: str = "float32", ref_device: str = "cpu") -> Report:
    """The gate's verdict on one engine trace under a golden entry's settings (``expect``,
    ``allow_unsupported``, ``triaged``): a GoldenError if the trace's models or prompts have changed
    since it was recorded, else the diff with unrecorded categories failed and reviewed findings triaged.
    The one judgement of a golden: the gate and ``refcheck diff`` (on the goldens) both call it."""
    with phase("stale_check"):
        stale = live_provenance_reasons(trace, session)
    if stale:
        raise GoldenError(f"stale golden {name}: " + "; ".join(stale)
                          + (f" (review and regenerate: refcheck golden regen --case {name} --reason ...)" if name in GOLDEN_CASES
                             else f" (an engine trace: record it again with its engine, e.g. SGLang's with "
                                  f"scripts/sglang_suite.py on a GPU, then replace it: refcheck golden add TRACE --case {name} "
                                  f"--reason ...; the manifest keeps the old entry in its history)"))
    policy = GatePolicy.of(name, settings)
    report = session.diff(trace, name, mode=mode, strict_acceptance=trace.prov.is_reference, ref_dtype=ref_dtype,
                          ref_device=ref_device)
    return policy.apply(report)


def entry_rules(entry) -> list[str]:
    """Everything a golden's manifest entry tells the gate, in words (for ``refcheck diff --against``
    a golden file: what the gate will apply that a plain diff does not)."""
    s = entry.provenance
    rules = [describe_expect(s.get("expect", "pass"), s.get("expect_first")) if s.get("expect", "pass") != "pass"
             else "expect pass: any failure fails the case"]
    if s.get("allow_unsupported"):
        rules.append("allow_unsupported " + ",".join(s["allow_unsupported"]) + ": checks the engine did not record in "
                     "these categories do not fail the case (any other unsupported or skipped check does)")
    else:
        rules.append("no allow_unsupported: every unsupported or skipped check fails the case")
    if s.get("triaged"):
        rules.append("triaged (reviewed findings reported as triaged): " + ", ".join(
            f"{t['request_id']} step {t['step']}" + ("" if t.get("node") is None else f" node {t['node']}") + f" {t['category']}"
            for t in s["triaged"]))
    return rules


def golden_entry_for(path: Path):
    """(case name, manifest entry) when ``path`` is a golden listed in the MANIFEST.json beside it, else None."""
    path = Path(path)
    if not (path.parent / "MANIFEST.json").is_file():
        return None
    try:
        manifest = load_manifest(path.parent)
    except (RefcheckError, OSError):
        return None  # a broken manifest beside a trace says nothing about this diff
    for name, entry in manifest.cases.items():
        if entry.file == path.name:
            return name, entry
    return None


def shared_work_key(entry) -> tuple:
    """Cases with equal keys share their free run's reference work (the target-only greedy
    continuations and the reference's own DDTree runs): one process should gate them together."""
    p = entry.provenance
    drafter = "scripted" if p.get("drafter") == "none" else p.get("drafter", "dflash")
    return (str(p.get("model", "")), str(drafter), str(p.get("budget")), int(p.get("max_new_tokens", 64)))


def estimated_cost(entry) -> float:
    """A case's cost for scheduling only (longest first): its trace's size, twice over for an engine
    in a coarser dtype than fp32, whose over-bound steps run the rounding ensemble."""
    heavy = str(entry.provenance.get("dtype", "float32")) != "float32"
    return float(entry.bytes) * (2.0 if heavy else 1.0)


def gate_jobs(manifest: Manifest, names: list[str]) -> list[list[str]]:
    """The cases as jobs for the gate's processes: cases that share work in one job, the costliest
    job first."""
    groups: dict[tuple, list[str]] = {}
    for n in names:
        groups.setdefault(shared_work_key(manifest.cases[n]), []).append(n)
    return sorted(groups.values(), key=lambda g: -sum(estimated_cost(manifest.cases[n]) for n in g))


def gate(golden_dir: Path, session: DiffSession, cases: list[str] | None = None, progress: Progress | None = None,
         workers: int | None = 1, profiles: dict[str, Profile] | None = None, cache_dir: Path | None = None,
         manifest: Manifest | None = None) -> list[Report]:
    """Verify the goldens' hashes, then each case's verdict (:func:`check_trace`), in the order of
    ``cases`` (default: every case). ``workers``: processes to spread the cases over (None: one per
    usable core; this process is one of them; :func:`gate_jobs` taken costliest first). ``profiles``:
    a dict that receives each case's :class:`Profile`. ``cache_dir``: reports cached there under a
    key of the golden's bytes, its settings, the packages' files and the environment
    (:mod:`refcheck.gate_cache`). ``manifest``: what :func:`verify` of ``golden_dir`` returned, when the
    caller has verified already (read once)."""
    from refcheck.parallel import usable_cpus

    manifest = verify(golden_dir) if manifest is None else manifest
    names = cases or sorted(manifest.cases)
    unknown = [n for n in names if n not in manifest.cases]
    if unknown:
        raise GoldenError(f"no golden trace for case(s) {unknown} in {golden_dir}")
    workers = usable_cpus() if workers is None else workers
    if workers > 1 and len(names) > 1:
        from refcheck.parallel import run_queue

        jobs = [(job, str(golden_dir), workers, profiles is not None, str(cache_dir) if cache_dir else None)
                for job in gate_jobs(manifest, names)]

        def finished(index: int, _result: object) -> None:
            for name in jobs[index][0]:
                tell(progress, f"gate: {name}")

        done = run_queue(gate_shard, jobs, workers, inline=lambda *job: gate_shard(*job, session=session),
                         on_result=finished)
        by_name = {r.case: r for rs, _ in done for r in rs}
        if profiles is not None:
            profiles.update({n: Profile.from_json(p) for _, ps in done for n, p in ps.items()})
        return [by_name[n] for n in names]
    from refcheck.gate_cache import ReportCache

    cache = ReportCache(Path(cache_dir)) if cache_dir else None
    reports = []
    for name in names:
        tell(progress, f"gate: {name}")
        reports.append(profiled_gate_case(name, manifest.cases[name], golden_dir, session, profiles, cache))
    return reports


_SESSION = None  # a gate worker's DiffSession, kept from job to job (its models and shared work)


def gate_shard(names: list[str], golden_dir: str, workers: int, profile: bool = False,
               cache_dir: str | None = None, session=None) -> tuple[list[Report], dict]:
    """Gate some golden cases in this process (torch threads: its share of the cores, restored
    after), with ``session`` or this process's own: (reports, case -> profile as JSON; empty unless
    ``profile``)."""
    import torch

    from refcheck.gate_cache import ReportCache
    from refcheck.parallel import worker_setup

    global _SESSION
    if session is None:
        session = _SESSION = _SESSION or DiffSession()
    threads = worker_setup(workers)
    try:
        manifest = load_manifest(Path(golden_dir))
        profiles: dict | None = {} if profile else None
        cache = ReportCache(Path(cache_dir)) if cache_dir else None
        reports = [profiled_gate_case(n, manifest.cases[n], Path(golden_dir), session, profiles, cache) for n in names]
        return reports, {n: p.to_json() for n, p in (profiles or {}).items()}
    finally:
        torch.set_num_threads(threads)
