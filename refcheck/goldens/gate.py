"""The CI gate: every golden case judged against the live reference, over one or more processes.

Contract: :func:`gate` takes a verified manifest (:func:`refcheck.goldens.verify.verify`, run here unless
the caller passes the manifest it verified), refuses an unknown case (:class:`~refcheck.errors.GoldenError`)
and judges each case with :func:`refcheck.goldens.judge.gate_case`, returning the reports in the order of
``cases`` (default: every case by name). With ``workers`` > 1 the cases go to that many processes
(None: one per usable core; this process is one of them) as the jobs of
:func:`refcheck.goldens.schedule.gate_jobs`, each worker (:func:`gate_shard`) keeping its
:class:`~refcheck.pool.ReferencePool` from job to job. ``profiles`` receives each case's
:class:`~refcheck.profile.Profile`; ``cache_dir`` reuses reports whose key is unchanged
(:mod:`refcheck.goldens.cache`). None of these changes a verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refcheck.diff.findings import Report
from refcheck.errors import GoldenError
from refcheck.goldens.cache import ReportCache
from refcheck.goldens.judge import gate_case
from refcheck.goldens.manifest import Manifest, ManifestEntry, load_manifest
from refcheck.goldens.schedule import gate_jobs
from refcheck.goldens.verify import verify
from refcheck.pool import ReferencePool
from refcheck.profile import Profile, count, phase
from refcheck.progress import Progress, tell


def cached_gate_case(name: str, entry: ManifestEntry, golden_dir: Path, pool: ReferencePool,
                     cache: ReportCache | None = None) -> Report:
    """:func:`gate_case` through ``cache`` (a :class:`refcheck.goldens.cache.ReportCache`, or None)."""
    if cache is None:
        return gate_case(name, entry, golden_dir, pool)
    with phase("cache"):
        report = cache.get(entry)
    if report is not None:
        count("cache_hits")
        return report
    report = gate_case(name, entry, golden_dir, pool)
    with phase("cache"):
        cache.put(entry, report)
    return report


def profiled_gate_case(name: str, entry: ManifestEntry, golden_dir: Path, pool: ReferencePool,
                       profiles: dict[str, Profile] | None, cache: ReportCache | None = None) -> Report:
    """:func:`cached_gate_case`, under a fresh profile stored in ``profiles[name]`` when ``profiles`` is given."""
    if profiles is None:
        return cached_gate_case(name, entry, golden_dir, pool, cache)
    prof = profiles[name] = Profile()
    with prof.active(), phase("gate.other"):
        return cached_gate_case(name, entry, golden_dir, pool, cache)


def _gate_in_workers(manifest: Manifest, names: list[str], golden_dir: Path, pool: ReferencePool,
                     progress: Progress | None, workers: int, profiles: dict[str, Profile] | None,
                     cache_dir: Path | None) -> list[Report]:
    """:func:`gate` over ``workers`` processes: one queue of :func:`gate_shard` jobs, this process one of them."""
    from refcheck.parallel import run_queue

    jobs = [(job, str(golden_dir), workers, profiles is not None, str(cache_dir) if cache_dir else None)
            for job in gate_jobs(manifest, names)]

    def finished(index: int, _result: object) -> None:
        for name in jobs[index][0]:
            tell(progress, f"gate: {name}")

    def inline(job: list[str], gdir: str, n: int, profile: bool, cache: str | None) -> tuple[list[Report], dict[str, Any]]:
        return gate_shard(job, gdir, n, profile, cache, pool=pool)

    done = run_queue(gate_shard, jobs, workers, inline=inline, on_result=finished)
    by_name = {r.case: r for rs, _ in done for r in rs}
    if profiles is not None:
        profiles.update({n: Profile.from_json(p) for _, ps in done for n, p in ps.items()})
    return [by_name[n] for n in names]


def gate(golden_dir: Path, pool: ReferencePool, cases: list[str] | None = None, progress: Progress | None = None,
         workers: int | None = 1, profiles: dict[str, Profile] | None = None, cache_dir: Path | None = None,
         manifest: Manifest | None = None) -> list[Report]:
    """Verify the goldens' hashes, then each case's verdict (:func:`refcheck.goldens.judge.check_trace`), in the
    order of ``cases`` (default: every case). ``workers``: processes to spread the cases over (None: one per
    usable core; this process is one of them; :func:`refcheck.goldens.schedule.gate_jobs` taken costliest
    first). ``profiles``: a dict that receives each case's :class:`Profile`. ``cache_dir``: reports cached
    there under a key of the golden's bytes, its settings, the packages' files and the environment
    (:mod:`refcheck.goldens.cache`). ``manifest``: what :func:`verify` of ``golden_dir`` returned, when the
    caller has verified already (read once)."""
    from refcheck.parallel import usable_cpus

    manifest = verify(golden_dir) if manifest is None else manifest
    names = cases or sorted(manifest.cases)
    unknown = [n for n in names if n not in manifest.cases]
    if unknown:
        raise GoldenError(f"no golden trace for case(s) {unknown} in {golden_dir}")
    workers = usable_cpus() if workers is None else workers
    if workers > 1 and len(names) > 1:
        return _gate_in_workers(manifest, names, golden_dir, pool, progress, workers, profiles, cache_dir)
    cache = ReportCache(Path(cache_dir)) if cache_dir else None
    reports = []
    for name in names:
        tell(progress, f"gate: {name}")
        reports.append(profiled_gate_case(name, manifest.cases[name], golden_dir, pool, profiles, cache))
    return reports


_POOL: ReferencePool | None = None  # a gate worker's reference pool, kept from job to job (its models and shared work)


def gate_shard(names: list[str], golden_dir: str, workers: int, profile: bool = False,
               cache_dir: str | None = None, pool: ReferencePool | None = None) -> tuple[list[Report], dict[str, Any]]:
    """Gate some golden cases in this process (torch threads: its share of the cores, restored
    after), with ``pool`` or this process's own: (reports, case -> profile as JSON; empty unless
    ``profile``)."""
    import torch

    from refcheck.parallel import worker_setup

    global _POOL
    if pool is None:
        pool = _POOL = _POOL or ReferencePool()
    threads = worker_setup(workers)
    try:
        manifest = load_manifest(Path(golden_dir))
        profiles: dict[str, Profile] | None = {} if profile else None
        cache = ReportCache(Path(cache_dir)) if cache_dir else None
        reports = [profiled_gate_case(n, manifest.cases[n], Path(golden_dir), pool, profiles, cache) for n in names]
        return reports, {n: p.to_json() for n, p in (profiles or {}).items()}
    finally:
        torch.set_num_threads(threads)
