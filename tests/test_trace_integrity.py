"""Trace integrity (schema 1.1): every flipped bit of a real golden is a corrupt trace naming where,
legacy 1.0 files read as unchecked, and malformed content is corrupt with request, step and node."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from refcheck.errors import EXIT_CORRUPT, CorruptTraceError
from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.manifest import load_manifest
from refcheck.trace import io as trace_io
from refcheck.trace import schema as trace_schema
from refcheck.trace.io import check_token_ids, read_trace, trace_bytes, trace_from_bytes, write_trace
from refcheck.trace.schema import TraceValidationError

from trace_helpers import assert_traces_equal, make_trace, rewrite, rewrite_legacy

GOLDEN_CASE = "hybrid-b15"


def _golden_bytes() -> bytes:
    """A real golden as this version writes it (sealed); equal to the stored file once it is sealed."""
    path = REPO_GOLDEN / load_manifest(REPO_GOLDEN).cases[GOLDEN_CASE].file
    return trace_bytes(read_trace(path))


def test_300_random_bit_flips_of_a_golden_are_all_detected() -> None:
    data = _golden_bytes()
    trace_from_bytes(data)  # the intact file reads
    rng = random.Random(19)
    where: dict[str, int] = {}
    t0 = time.perf_counter()
    for _ in range(300):
        b = bytearray(data)
        bit = rng.randrange(len(b) * 8)
        b[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptTraceError) as exc:
            trace_from_bytes(bytes(b), "golden")
        msg = str(exc.value)
        kind = ("batch" if "record batch 0" in msg else "requests" if "requests table" in msg
                else "checksum" if "checksum" in msg else "arrow" if "Arrow" in msg or "magic" in msg else "other")
        where[kind] = where.get(kind, 0) + 1
    assert sum(where.values()) == 300 and "other" not in where, where
    assert where.get("batch", 0) > 50, where  # most of the file is the steps' record batch, and it is named
    assert time.perf_counter() - t0 < 30


def test_flip_inside_the_record_batch_is_named(tmp_path: Path) -> None:
    data = bytearray(_golden_bytes())
    data[len(data) // 2] ^= 0x10  # the middle of the file is step data
    with pytest.raises(CorruptTraceError, match=r"checksum mismatch in record batch 0"):
        trace_from_bytes(bytes(data), "g.arrow")


def test_serialization_is_deterministic_and_round_trips() -> None:
    trace = make_trace(n_requests=2, n_steps=3)
    a, b = trace_bytes(trace), trace_bytes(trace)
    assert a == b
    back = trace_from_bytes(a)
    assert back.checksummed and back.schema_version == trace_schema.SCHEMA_VERSION
    assert_traces_equal(trace, back)


def test_legacy_file_reads_unchecked(tmp_path: Path) -> None:
    trace = make_trace(n_requests=1, n_steps=2)
    write_trace(trace, tmp_path / "new.arrow")
    rewrite_legacy(tmp_path / "new.arrow", tmp_path / "old.arrow",
                   meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"1.0"})
    back = read_trace(tmp_path / "old.arrow")
    assert not back.checksummed and back.schema_version == "1.0"
    back.schema_version, back.checksummed = trace_schema.SCHEMA_VERSION, True
    assert_traces_equal(trace, back)


def test_new_version_without_checksums_is_corrupt(tmp_path: Path) -> None:
    write_trace(make_trace(n_requests=1, n_steps=2), tmp_path / "new.arrow")
    rewrite_legacy(tmp_path / "new.arrow", tmp_path / "stripped.arrow",
                   meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"1.1"})
    with pytest.raises(CorruptTraceError, match="without its checksums"):
        read_trace(tmp_path / "stripped.arrow")


def test_requests_table_change_is_named(tmp_path: Path) -> None:
    write_trace(make_trace(n_requests=1, n_steps=2), tmp_path / "a.arrow")
    data = (tmp_path / "a.arrow").read_bytes()
    reader = trace_io.pa.ipc.open_file(trace_io.pa.py_buffer(data))
    meta = dict(reader.schema.metadata)
    table = reader.read_all()
    # a writer that sealed the file, then someone swapped the requests bytes but kept the old checksums
    sealed = trace_io.sealed_file_bytes(table.schema.with_metadata(meta), table.to_batches())
    forged = sealed.replace(meta[trace_schema.KEY_REQUESTS_SHA256], b"f" * 64)
    with pytest.raises(CorruptTraceError, match="requests table"):
        trace_from_bytes(forged)


def _malformed(tmp_path: Path, mutate) -> Path:
    """A sealed file (valid checksums) whose content breaks a rule: only the content check can catch it."""
    trace = make_trace(n_requests=1, n_steps=3)
    write_trace(trace, tmp_path / "ok.arrow")
    rewrite(tmp_path / "ok.arrow", tmp_path / "bad.arrow", table_fn=mutate)
    return tmp_path / "bad.arrow"


def _set(table, column: str, row: int, value):
    import pyarrow as pa

    values = table.column(column).to_pylist()
    values[row] = value
    idx = table.column_names.index(column)
    return table.set_column(idx, table.schema.field(idx), pa.array(values, table.schema.field(idx).type))


@pytest.mark.parametrize("mutate, match", [
    (lambda t: _set(t, "tree_parents", 1, [-1, 7, 0, 1, 2, 3, 4][: len(t.column("tree_parents")[1])]),
     r"request 'req-0' step 1 node 1: parent 7 out of range"),
    (lambda t: _set(t, "tree_parents", 0, [-1, 0, 2] + t.column("tree_parents")[0].as_py()[3:]),
     r"step 0 node 2: parent 2 out of range"),
    (lambda t: _set(t, "tree_parents", 2, [3] + t.column("tree_parents")[2].as_py()[1:]), r"step 2 node 0: the root"),
    (lambda t: _set(t, "tree_depths", 1, [0, 5] + t.column("tree_depths")[1].as_py()[2:]), r"step 1 node 1: depth 5"),
    (lambda t: _set(t, "step", 1, 5), r"request 'req-0' step 2: steps must run .* step 1 is missing"),
    (lambda t: _set(t, "step", 0, 3), r"step 1: steps must run .* step 0 is missing"),
    (lambda t: _set(t, "step", 2, 1), r"request 'req-0' has step 1 twice"),
], ids=["parent-beyond", "parent-self", "root-parent", "depth", "step-jump", "step-missing-0", "step-duplicate"])
def test_malformed_content_is_corrupt(tmp_path: Path, mutate, match: str) -> None:
    with pytest.raises(TraceValidationError, match=match) as exc:
        read_trace(_malformed(tmp_path, mutate))
    assert exc.value.exit_code == EXIT_CORRUPT


def test_token_ids_outside_the_vocabulary() -> None:
    trace = make_trace(n_requests=1, n_steps=2)
    check_token_ids(trace, 1000)
    trace.steps[1].topk_ids[3][1] = 1000
    with pytest.raises(TraceValidationError, match=r"request 'req-0' step 1 node 3: topk_ids holds 1000"):
        check_token_ids(trace, 1000)
    trace.steps[1].topk_ids[3][1] = 0
    trace.steps[0].tree_tokens[2] = -1
    with pytest.raises(TraceValidationError, match=r"step 0 node 2: tree_tokens -1 is outside"):
        check_token_ids(trace, 1000)


def test_flipped_golden_is_corrupt_not_a_finding(cli, tmp_path: Path) -> None:
    data = bytearray(_golden_bytes())
    data[len(data) // 3] ^= 0x04
    (tmp_path / "flipped.arrow").write_bytes(bytes(data))
    code, _, err = cli("diff", "--against", str(tmp_path / "flipped.arrow"))
    assert code == EXIT_CORRUPT and "checksum mismatch" in err and "Traceback" not in err


def test_repository_goldens_are_sealed() -> None:
    """Every golden carries checksums, and its history is one unbroken chain of contents ending at the
    manifest's sha256 (a seal or a rule change that skipped a content, or a file swapped behind the
    manifest's back, breaks the chain). Goldens added after trace schema 1.1 were written checksummed."""
    manifest = load_manifest(REPO_GOLDEN)
    for case, entry in manifest.cases.items():
        assert read_trace(REPO_GOLDEN / entry.file).checksummed, case
        shas = [(h.sha256_old, h.sha256_new) for h in entry.history]
        for (_, new), (old, _) in zip(shas, shas[1:]):
            assert old == new, f"{case}: history chain broken"
        if shas:
            assert shas[-1][1] == entry.sha256, f"{case}: last history entry is not the current content"


def test_seal_script_proves_content_and_is_idempotent(cli, tmp_path: Path) -> None:
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("seal_goldens", Path(__file__).parents[1] / "scripts" / "seal_goldens.py")
    seal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seal)
    gdir = tmp_path / "g"
    gdir.mkdir()
    entry = load_manifest(REPO_GOLDEN).cases["hybrid-b1"]
    rewrite_legacy(REPO_GOLDEN / entry.file, tmp_path / "legacy.arrow",
                   meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"1.0"})
    shutil.copy(tmp_path / "legacy.arrow", gdir / "hybrid-b1.arrow")
    from refcheck.goldens import store

    store.commit(gdir, [store.Write("hybrid-b1", (gdir / "hybrid-b1.arrow").read_bytes(), entry.provenance)])
    legacy = read_trace(gdir / "hybrid-b1.arrow")
    assert not legacy.checksummed
    code, _, err = cli("golden", "verify", "--golden", str(gdir))
    assert code == 0 and "without their own checksums" in err and "hybrid-b1" in err
    (case, digest, _, _), = seal.seal(gdir)
    sealed = read_trace(gdir / "hybrid-b1.arrow")
    assert case == "hybrid-b1" and sealed.checksummed
    assert seal.content_sha256(sealed) == seal.content_sha256(legacy) == digest
    assert seal.content_sha256(read_trace(REPO_GOLDEN / entry.file)) == digest  # the repository's sealed golden too
    assert seal.seal(gdir) == []  # idempotent
    sealed.steps[0].topk_logprobs[0][0] += 1e-3  # the digest sees a changed value
    assert seal.content_sha256(sealed) != digest


def test_a_sampled_capture_may_hold_some_steps_only(tmp_path):
    """A trace whose capture declares 1 step in N > 1 (or records its queue lost, batches past its byte budget, or
    records a rolling budget deleted) holds the steps it recorded,
    numbered as the engine ran them; distinct and non-negative, and written and read back whole. Without the
    declaration the same gap is refused."""
    from dataclasses import replace

    trace = make_trace(n_requests=2, n_steps=4)
    kept = [s for s in trace.steps if s.step in (1, 3)]
    gapped = replace(trace, steps=kept, provenance={**trace.provenance, "capture": {"sample": {"every": 2, "seed": 0}}})
    write_trace(gapped, tmp_path / "sampled.arrow")
    back = read_trace(tmp_path / "sampled.arrow")
    assert sorted({s.step for s in back.steps}) == [1, 3]
    lost = replace(gapped, provenance={**trace.provenance, "capture": {"stats": {"lost_batches": 2}}})
    write_trace(lost, tmp_path / "lost.arrow")
    over = replace(gapped, provenance={**trace.provenance, "capture": {"stats": {"over_budget_batches": 2}}})
    write_trace(over, tmp_path / "over-budget.arrow")
    rolled = replace(gapped, provenance={**trace.provenance, "capture": {"stats": {"rolled_out_records": 2}}})
    write_trace(rolled, tmp_path / "rolled.arrow")
    with pytest.raises(TraceValidationError, match="steps must run 0, 1, 2"):
        write_trace(replace(gapped, provenance=trace.provenance), tmp_path / "undeclared.arrow")
    twice = replace(gapped, steps=kept + [kept[0]])
    with pytest.raises(TraceValidationError, match="has step 1 twice"):
        write_trace(twice, tmp_path / "twice.arrow")
