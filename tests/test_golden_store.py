"""The golden store (refcheck/trace/store.py): crash at every write step, concurrent writers, the
writer lock, plain case names, leftovers and cleaning."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from refcheck.errors import EXIT_CORRUPT, EXIT_GOLDEN, EXIT_PASS, EXIT_USAGE, GoldenLockError, UsageError
from refcheck.golden import verify
from refcheck.trace import store
from refcheck.trace.io import trace_bytes
from refcheck.trace.manifest import load_manifest, sha256_bytes, sha256_file

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
from refcheck.trace import store
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
    script = ("import sys; from pathlib import Path; from refcheck.trace import store; "
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
