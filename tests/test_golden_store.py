"""The golden store (refcheck/goldens/store.py): crash at every write step, concurrent writers, the
writer lock, plain case names, leftovers and cleaning; a journal obeyed only when it is its own
transaction's, a regeneration that meets a removal, failures while staging (a full disk), the
up-front checks of `golden regen`, the manifest's policy shapes and names printed escaped."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from refcheck.errors import (
    EXIT_CORRUPT,
    EXIT_GOLDEN,
    EXIT_PASS,
    EXIT_USAGE,
    CorruptTraceError,
    GoldenError,
    GoldenLockError,
    OutputPathError,
    UsageError,
)
from refcheck.goldens import regen, store
from refcheck.goldens.manifest import load_manifest, sha256_bytes, sha256_file
from refcheck.goldens.policy import GatePolicy
from refcheck.goldens.verify import verify
from refcheck.trace.io import trace_bytes

from trace_helpers import make_trace

ROOT = Path(__file__).resolve().parents[1]


def _bytes(seed: int) -> bytes:
    trace = make_trace(n_requests=1, n_steps=2)
    trace.provenance["seed"] = seed
    return trace_bytes(trace)


OLD = {c: _bytes(i) for i, c in enumerate("abc")}
NEW_A, NEW_D = _bytes(10), _bytes(11)


def _initial(gdir: Path) -> None:
    store.commit(gdir, [store.Write(c, data, {"seed": i}) for i, (c, data) in enumerate(OLD.items())])


# the transaction under test: replace a, add d, remove c (every kind of change at once)
_TXN = """
import sys
from pathlib import Path
from refcheck.goldens import store
gdir, new_a, new_d = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()
store.commit(gdir, [store.Write("a", new_a, {"seed": 10}, "r"), store.Write("d", new_d, {"seed": 11}, "r")],
             [store.Remove("c", "gone")])
"""


def _run_txn(gdir: Path, tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp / "new_a").write_bytes(NEW_A)
    (tmp / "new_d").write_bytes(NEW_D)
    return subprocess.run([sys.executable, "-c", _TXN, str(gdir), str(tmp / "new_a"), str(tmp / "new_d")],
                          env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, timeout=120)


def _state(gdir: Path) -> str:
    """'old' or 'new' for the whole store after verify; fails on any mix."""
    manifest = verify(gdir)
    files = {c: sha256_file(gdir / e.file) for c, e in manifest.cases.items()}
    if files == {c: sha256_bytes(d) for c, d in OLD.items()}:
        return "old"
    assert files == {"a": sha256_bytes(NEW_A), "b": sha256_bytes(OLD["b"]), "d": sha256_bytes(NEW_D)}, files
    assert [r["case"] for r in manifest.removed] == ["c"]
    return "new"


@pytest.mark.slow
def test_crash_after_every_write_step_leaves_old_or_new(tmp_path: Path) -> None:
    seen: dict[int, str] = {}
    k = 1
    while True:
        gdir = tmp_path / f"g{k}"
        _initial(gdir)
        proc = _run_txn(gdir, tmp_path, {store.CRASH_ENV: str(k)})
        if proc.returncode == 0:
            assert _state(gdir) == "new"
            break
        assert proc.returncode == store.CRASH_EXIT, proc.stderr
        seen[k] = _state(gdir)  # verify rolls a committed journal forward
        assert not (gdir / store.JOURNAL_NAME).exists()
        left = store.leftovers(gdir, load_manifest(gdir))
        if seen[k] == "old":  # an aborted transaction leaves only staged files, cleaned on request
            assert left.orphans == [] and all(n.endswith(store.STAGED_SUFFIX) for n in left.temporary)
            store.clean(gdir)
            assert store.leftovers(gdir, load_manifest(gdir)).temporary == []
        else:
            assert left.temporary == [] and left.orphans == []
        k += 1
    # 3 staged files (a, d, manifest), the journal, 2 renames, the manifest switch, 1 delete, done
    assert len(seen) == 9, seen
    assert [seen[i] for i in sorted(seen)] == ["old"] * 3 + ["new"] * 6


@pytest.mark.slow
def test_crash_at_every_step_of_cli_remove(tmp_path: Path) -> None:
    results = []
    for k in range(1, 8):
        gdir = tmp_path / f"g{k}"
        _initial(gdir)
        proc = subprocess.run([sys.executable, "-m", "refcheck", "golden", "remove", "b", "--reason", "x",
                               "--golden", str(gdir)], env={**os.environ, store.CRASH_ENV: str(k)},
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        manifest = verify(gdir)
        results.append((proc.returncode, "b" in manifest.cases))
        assert ("b" in manifest.cases) == (gdir / "b.arrow").exists()
        if proc.returncode == 0:
            break
    # stage manifest (old), journal, switch, delete, done (all new), then a clean run
    assert results == [(86, True), (86, False), (86, False), (86, False), (86, False), (0, False)]


def test_concurrent_writers_both_land(tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    script = ("import sys; from pathlib import Path; from refcheck.goldens import store; "
              "store.commit(Path(sys.argv[1]), [store.Write(sys.argv[2], Path(sys.argv[3]).read_bytes(), {}, 'r')])")
    procs = []
    for case, data in (("x", NEW_A), ("y", NEW_D)):
        (tmp_path / case).write_bytes(data)
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(gdir), case, str(tmp_path / case)], cwd=ROOT))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    manifest = verify(gdir)
    assert set(manifest.cases) == {"a", "b", "c", "x", "y"}


def _hold_lock(gdir: Path, seconds: float) -> threading.Thread:
    fd = os.open(gdir, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def release() -> None:
        time.sleep(seconds)
        os.close(fd)

    t = threading.Thread(target=release)
    t.start()
    return t


def test_second_writer_waits_then_lands_or_refuses(tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    holder = _hold_lock(gdir, 0.6)
    with pytest.raises(GoldenLockError, match="locked by another writer"):
        store.commit(gdir, [store.Write("x", NEW_A, {})], timeout=0.1)
    assert "x" not in load_manifest(gdir).cases
    t0 = time.monotonic()
    store.commit(gdir, [store.Write("x", NEW_A, {})], timeout=10)  # waits for the holder, then lands
    assert time.monotonic() - t0 >= 0.3
    holder.join()
    assert "x" in verify(gdir).cases


@pytest.mark.parametrize("name", ["../x", "../../x", "a/b", ".hidden", "..", ".", "", "a..b", "x\\y", "a\x00b",
                                  "a b", "x" * 101, "/abs"])
def test_case_names_are_plain(name: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a plain name"):
        store.commit(tmp_path / "g", [store.Write(name, NEW_A, {})])
    assert not (tmp_path / "x.arrow").exists() and not (tmp_path.parent / "x.arrow").exists()


def test_read_only_directory_is_refused_before_work(tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    before = {p.name: p.read_bytes() for p in gdir.iterdir()}
    gdir.chmod(0o555)
    try:
        if os.access(gdir, os.W_OK):
            pytest.skip("running as a user that ignores directory permissions")
        with pytest.raises(UsageError, match="not writable"):
            store.commit(gdir, [store.Write("a", NEW_A, {}, "r")])
    finally:
        gdir.chmod(0o755)
    assert {p.name: p.read_bytes() for p in gdir.iterdir()} == before


def test_in_process_failure_before_commit_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    before = sorted(p.name for p in gdir.iterdir())
    monkeypatch.setattr(store, "atomic_write_bytes", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        store.commit(gdir, [store.Write("a", NEW_A, {}, "r")])
    assert sorted(p.name for p in gdir.iterdir()) == before and _state(gdir) == "old"


def test_verify_warns_and_cleans_leftovers(cli, tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    (gdir / "stray.arrow").write_bytes(NEW_A)
    (gdir / ".a.arrow.0123.staged").write_bytes(b"x")
    (gdir / ".MANIFEST.json.abc.tmp").write_bytes(b"x")
    (gdir / "a.arrow.pending").write_bytes(b"x")
    code, _, err = cli("golden", "verify", "--golden", str(gdir))
    assert code == EXIT_PASS
    assert "orphan trace stray.arrow" in err and "leftover temporary file .a.arrow.0123.staged" in err
    assert ".MANIFEST.json.abc.tmp" in err and "pending golden a.arrow.pending" in err
    code, _, err = cli("golden", "verify", "--golden", str(gdir), "--clean")
    assert code == EXIT_PASS and "removed .a.arrow.0123.staged" in err and "removed a.arrow.pending" in err
    assert sorted(p.name for p in gdir.iterdir()) == ["MANIFEST.json", "a.arrow", "b.arrow", "c.arrow", "stray.arrow"]
    code, _, _ = cli("golden", "verify", "--golden", str(gdir), "--clean-orphans")
    assert code == EXIT_PASS and not (gdir / "stray.arrow").exists()


def test_remove_keeps_history_and_refuses_unknown(cli, tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    code, _, err = cli("golden", "remove", "zzz", "--reason", "x", "--golden", str(gdir))
    assert code == EXIT_GOLDEN and "no golden case 'zzz'" in err
    code, _, err = cli("golden", "remove", "../a", "--reason", "x", "--golden", str(gdir))
    assert code == EXIT_USAGE and "not a plain name" in err
    code, _, _ = cli("golden", "remove", "b", "--reason", "obsolete", "--golden", str(gdir))
    assert code == EXIT_PASS and not (gdir / "b.arrow").exists()
    manifest = load_manifest(gdir)
    assert set(manifest.cases) == {"a", "c"} and manifest.removed[0]["reason"] == "obsolete"
    assert manifest.removed[0]["entry"]["sha256"] == sha256_bytes(OLD["b"])


def test_symlinked_golden_is_a_problem(cli, tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    outside = tmp_path / "outside.arrow"
    shutil.move(gdir / "a.arrow", outside)
    (gdir / "a.arrow").symlink_to(outside)
    code, _, err = cli("golden", "verify", "--golden", str(gdir))
    assert code == EXIT_CORRUPT and "symbolic link" in err
    # a write replaces the link itself, never the file it points to
    store.commit(gdir, [store.Write("a", NEW_A, {}, "r")])
    assert outside.read_bytes() == OLD["a"] and not (gdir / "a.arrow").is_symlink()


def test_readers_wait_for_a_writer_and_share_with_each_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    holder = _hold_lock(gdir, 0.6)  # a writer mid-change
    monkeypatch.setenv(store.LOCK_TIMEOUT_ENV, "0.1")
    with pytest.raises(GoldenLockError, match="locked by a writer"):
        verify(gdir)
    monkeypatch.setenv(store.LOCK_TIMEOUT_ENV, "10")
    assert set(verify(gdir).cases) == {"a", "b", "c"}  # waited for the writer
    holder.join()
    with store.locked(gdir, shared=True):  # another reader does not block verify
        monkeypatch.setenv(store.LOCK_TIMEOUT_ENV, "0.1")
        assert set(verify(gdir).cases) == {"a", "b", "c"}


# ------------------------------------------------------------------------ the journal is bound
def _interrupted(gdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the replace-a / add-d / remove-c transaction up to its commit point, then stop (as a process
    killed right after writing its journal)."""
    def stop(*_a: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(store, "_apply", stop)
        with pytest.raises(KeyboardInterrupt):
            store.commit(gdir, [store.Write("a", NEW_A, {"seed": 10}, "r"), store.Write("d", NEW_D, {"seed": 11}, "r")],
                         [store.Remove("c", "gone")])
    assert (gdir / store.JOURNAL_NAME).exists()


@pytest.mark.parametrize("partly", [False, True])
def test_a_genuine_interrupted_transaction_is_rolled_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              partly: bool) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    _interrupted(gdir, monkeypatch)
    assert _state_files(gdir)["a"] == sha256_bytes(OLD["a"])
    journal = store.read_journal(gdir)
    assert journal is not None and set(journal.sha256) == {s for s, _ in journal.renames} | {journal.manifest}
    if partly:  # killed in the middle of rolling forward: a renamed, the manifest switched
        os.replace(gdir / journal.renames[0][0], gdir / journal.renames[0][1])
        os.replace(gdir / journal.manifest, gdir / "MANIFEST.json")
    assert _state(gdir) == "new" and not (gdir / store.JOURNAL_NAME).exists()
    assert store.leftovers(gdir, load_manifest(gdir)).temporary == []


def _state_files(gdir: Path) -> dict[str, str]:
    return {p.stem: sha256_file(p) for p in gdir.glob("*.arrow")}


def _listing(gdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(gdir.iterdir())}


def _edit_journal(gdir: Path, fn) -> None:
    obj = json.loads((gdir / store.JOURNAL_NAME).read_text())
    fn(obj)
    (gdir / store.JOURNAL_NAME).write_text(json.dumps(obj))


@pytest.mark.parametrize("forge", ["delete-live-case", "delete-manifest", "rename-onto-other-case", "staged-changed",
                                   "old-format", "other-txid"])
def test_a_journal_that_is_not_its_transactions_is_left_alone(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              forge: str) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    _interrupted(gdir, monkeypatch)
    journal = store.read_journal(gdir)
    assert journal is not None
    staged_a = journal.renames[0][0]
    if forge == "delete-live-case":
        _edit_journal(gdir, lambda o: o["deletes"].append("b.arrow"))
    elif forge == "delete-manifest":
        _edit_journal(gdir, lambda o: o["deletes"].append("MANIFEST.json"))
    elif forge == "rename-onto-other-case":
        _edit_journal(gdir, lambda o: o["renames"][0].__setitem__(1, "b.arrow"))
    elif forge == "staged-changed":
        (gdir / staged_a).write_bytes(NEW_D)
    elif forge == "old-format":
        _edit_journal(gdir, lambda o: (o.pop("sha256"), o.update(version=1)))
    else:
        _edit_journal(gdir, lambda o: o.update(txid="ffffffffffff"))
    before = _listing(gdir)
    code, _, err = cli("golden", "verify", "--golden", str(gdir))
    assert code == EXIT_CORRUPT and "Traceback" not in err, err
    assert err.count("refcheck: error:") == 1 and "it was left alone (nothing was renamed or deleted)" in err
    with pytest.raises(CorruptTraceError, match="left alone"):
        store.clean(gdir)
    with pytest.raises(CorruptTraceError, match="left alone"):
        store.commit(gdir, removes=[store.Remove("b", "x")])
    assert _listing(gdir) == before


# ------------------------------------------------------------------ regen beside a removal
class _Runner:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def trace(self, prompts):
        trace = make_trace(n_requests=1, n_steps=2)
        trace.provenance["seed"] = self.seed
        return trace, None


class _Pool:
    """Stands in for ReferencePool: every case decodes a small synthetic trace; counts the decodes."""

    decodes = 0

    def runner(self, spec):
        type(self).decodes += 1
        return _Runner(99)


CASE_B1 = "attention-b1"


def _with_case(gdir: Path) -> None:
    store.commit(gdir, [store.Write(CASE_B1, OLD["a"], {"seed": 0}, "r")])


def _before_commit(monkeypatch: pytest.MonkeyPatch, action) -> None:
    """Run ``action`` once, between regen's decoding and its commit (another writer's turn)."""
    real, done = store.commit, []

    def hooked(*args, **kwargs):
        if not done:
            done.append(True)
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "commit", hooked)


def test_regen_of_a_case_removed_meanwhile_refuses(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gdir = tmp_path / "g"
    _with_case(gdir)
    monkeypatch.setattr("refcheck.pool.ReferencePool", _Pool)
    codes = []
    _before_commit(monkeypatch, lambda: codes.append(cli("golden", "remove", CASE_B1, "--reason", "retired",
                                                         "--golden", str(gdir))[0]))
    code, _, err = cli("golden", "regen", "--case", CASE_B1, "--accept", "--reason", "r", "--golden", str(gdir))
    assert codes == [EXIT_PASS] and code == EXIT_GOLDEN and "Traceback" not in err
    assert f"golden case '{CASE_B1}' was removed (reason: retired) by another writer" in err
    manifest = _manifest_of(gdir)
    assert CASE_B1 not in manifest.cases and [r["case"] for r in manifest.removed] == [CASE_B1]
    assert not (gdir / f"{CASE_B1}.arrow").exists()


def _manifest_of(gdir: Path):
    with store.reading(gdir):
        return load_manifest(gdir)


@pytest.mark.parametrize("meanwhile", ["replaced", "added"])
def test_regen_of_a_case_changed_meanwhile_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str) -> None:
    gdir = tmp_path / "g"
    if meanwhile == "replaced":
        _with_case(gdir)
    else:
        _initial(gdir)
    _before_commit(monkeypatch, lambda: store.commit(gdir, [store.Write(CASE_B1, NEW_D, {"seed": 11}, "other")]))
    with pytest.raises(GoldenError, match=f"'{CASE_B1}' was {meanwhile} by another writer"):
        regen.regenerate(gdir, [CASE_B1], "r", True, _Pool())  # type: ignore[arg-type]
    assert load_manifest(gdir).cases[CASE_B1].sha256 == sha256_bytes(NEW_D)


def test_regen_of_an_unchanged_store_lands(tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _with_case(gdir)
    regen.regenerate(gdir, [CASE_B1], "r", True, _Pool())  # type: ignore[arg-type]
    entry = verify(gdir).cases[CASE_B1]
    assert entry.history[-1].sha256_old == sha256_bytes(OLD["a"]) and entry.history[-1].reason == "r"


# ------------------------------------------------------------------------ a full disk, staging
def _full_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """``os.fsync`` fails with ENOSPC at its ``call``-th call (1-based) from now on."""
    real, calls = os.fsync, []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) >= call:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("call", [1, 2])
def test_a_full_disk_while_staging_leaves_no_staged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    before = _listing(gdir)
    _full_at(monkeypatch, call)  # 1: the first staged trace itself; 2: the staged manifest after it
    with pytest.raises(UsageError, match="No space left on device; nothing was changed"):
        store.commit(gdir, [store.Write("a", NEW_A, {}, "r")])
    monkeypatch.undo()
    assert _listing(gdir) == before and _state(gdir) == "old"


def test_golden_add_on_a_full_disk_fails_cleanly(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    before = _listing(gdir)
    shutil.copy(ROOT / "golden" / "zlab-hybrid-chain.arrow", tmp_path / "t.arrow")
    monkeypatch.setattr("refcheck.goldens.judge.check_trace", lambda *a, **k: type("R", (), {"verdict": "pass"})())
    _full_at(monkeypatch, 1)
    code, _, err = cli("golden", "add", str(tmp_path / "t.arrow"), "--case", "x", "--reason", "r", "--golden", str(gdir))
    assert code == EXIT_USAGE and "Traceback" not in err and "No space left on device; nothing was changed" in err, err
    assert _listing(gdir) == before


def test_a_change_larger_than_the_free_space_is_refused_before_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    before = _listing(gdir)
    real = store.free_bytes
    monkeypatch.setattr(store, "free_bytes", lambda p: store.MIN_FREE_BYTES if Path(p) == gdir else real(p))
    with pytest.raises(OutputPathError, match="the change needs .* bytes, its file system has"):
        store.commit(gdir, [store.Write("big", b"x" * (store.MIN_FREE_BYTES + 1), {}, "r")])
    assert _listing(gdir) == before


# ------------------------------------------------------------------ golden regen: checked first
def _regen(cli, gdir: Path, *extra: str) -> tuple[int, str]:
    _Pool.decodes = 0
    code, _, err = cli("golden", "regen", "--case", CASE_B1, "--golden", str(gdir), *extra)
    assert "Traceback" not in err and err.count("refcheck: error:") == 1, err
    return code, err


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("refcheck.pool.ReferencePool", _Pool)


@pytest.mark.parametrize("accept", [(), ("--accept", "--reason", "r")])
def test_regen_into_a_full_directory_is_refused_before_decoding(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                fake_pool: None, accept: tuple[str, ...]) -> None:
    gdir = tmp_path / "g"
    _with_case(gdir)
    monkeypatch.setattr(store, "free_bytes", lambda p: 4096)
    code, err = _regen(cli, gdir, *accept)
    assert code == EXIT_USAGE and "its file system is full (4096 bytes free" in err and _Pool.decodes == 0


@pytest.mark.parametrize("accept", [(), ("--accept", "--reason", "r")])
def test_regen_into_a_read_only_directory_is_refused_before_decoding(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     fake_pool: None, accept: tuple[str, ...]) -> None:
    gdir = tmp_path / "g"
    _with_case(gdir)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == gdir and mode & os.W_OK else real(p, mode, **k))
    code, err = _regen(cli, gdir, *accept)
    assert code == EXIT_USAGE and "is not writable" in err and _Pool.decodes == 0


def test_regen_on_a_late_full_disk_fails_cleanly(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 fake_pool: None) -> None:
    gdir = tmp_path / "g"
    _with_case(gdir)
    before = _listing(gdir)
    _full_at(monkeypatch, 1)
    code, err = _regen(cli, gdir, "--accept", "--reason", "r")
    assert code == EXIT_USAGE and "No space left on device; nothing was changed" in err
    monkeypatch.setattr(regen, "atomic_write_bytes", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    code, err = _regen(cli, gdir)
    assert code == EXIT_USAGE and f"{CASE_B1}.arrow.pending: No space left on device; the goldens are unchanged" in err
    assert _listing(gdir) == before


def test_regen_refuses_a_case_named_twice_before_decoding(tmp_path: Path) -> None:
    _Pool.decodes = 0
    with pytest.raises(UsageError, match=f"--case {CASE_B1} is given more than once"):
        regen.regenerate(tmp_path / "g", [CASE_B1, "hybrid-b1", CASE_B1], "r", True, _Pool())  # type: ignore[arg-type]
    assert _Pool.decodes == 0 and not (tmp_path / "g").exists()


# ------------------------------------------------------------- manifest shapes, escaped names
@pytest.mark.parametrize(("key", "value"), [("triaged", [1]), ("allow_unsupported", 5), ("expect_first", "garbage"),
                                            ("expect", 3), ("triaged", [{"request_id": "a", "step": "0", "node": None,
                                                                         "category": "logits"}])])
def test_policy_of_another_shape_is_a_golden_error(key: str, value: object) -> None:
    with pytest.raises(GoldenError, match=rf"golden x: manifest {key}(\[0\])? is"):
        GatePolicy.of("x", {"expect": "fail", key: value})


def test_the_repository_manifest_loads_and_keeps_every_key(tmp_path: Path) -> None:
    text = (ROOT / "golden" / "MANIFEST.json").read_text()
    assert json.loads(load_manifest(ROOT / "golden").to_bytes()) == json.loads(text)


def test_names_from_the_directory_are_printed_escaped(cli, tmp_path: Path) -> None:
    gdir = tmp_path / "g"
    _initial(gdir)
    (gdir / "x\nrefcheck: error: forged.arrow").write_bytes(b"x")
    (gdir / ".a.arrow.1\nrefcheck: error: y.staged").write_bytes(b"x")
    code, _, err = cli("golden", "verify", "--golden", str(gdir))
    assert code == EXIT_PASS and not [line for line in err.splitlines() if line.startswith("refcheck: error:")], err
    assert "warning: orphan trace 'x\\nrefcheck: error: forged.arrow'" in err
    assert "warning: leftover temporary file '.a.arrow.1\\nrefcheck: error: y.staged'" in err
