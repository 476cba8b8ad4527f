"""Bad-input corpus entries of the golden store (manifests, journal, removals and regenerations, staging), joined to the corpus by
tests/test_bad_inputs.py (builders: tests/bad_input_kit.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bad_input_kit import CASE, Bad, edit_manifest, golden_dir, trace_copy, write

from refcheck.errors import EXIT_CORRUPT, EXIT_USAGE
from refcheck.goldens import store

TXID = "0123456789ab"
FORGED = "x\nrefcheck: error: forged"


# ------------------------------------------------------------------------------ builders
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def journal(work: Path, renames: list[list[str]] | None = None, deletes: list[str] | None = None,
            staged: dict[str, bytes] | None = None, manifest_sha: str | None = None, tampered: bool = False) -> Path:
    """A golden directory of one case with a hand-written journal of transaction TXID that parses: its
    manifest recorded as the live MANIFEST.json's bytes (``manifest_sha`` overrides), ``staged`` files
    written and recorded with their sha256 (``tampered``: the files then lose their last byte)."""
    gdir = golden_dir(work)
    staged = staged or {}
    manifest = store.staged_name("MANIFEST.json", TXID)
    digests = {manifest: manifest_sha or _sha((gdir / "MANIFEST.json").read_bytes()),
               **{name: _sha(data) for name, data in staged.items()}}
    for name, data in staged.items():
        (gdir / name).write_bytes(data[:-1] if tampered else data)
    obj = {"version": store.JOURNAL_VERSION, "txid": TXID, "renames": renames or [], "manifest": manifest,
           "deletes": deletes or [], "sha256": digests}
    (gdir / store.JOURNAL_NAME).write_text(json.dumps(obj))
    return gdir


def _old_journal(work: Path) -> Path:
    """The journal format before transactions were bound to their files: it parsed and was obeyed."""
    gdir = golden_dir(work)
    (gdir / store.JOURNAL_NAME).write_text(json.dumps({"txid": "x", "renames": [], "manifest": ".nope",
                                                       "deletes": ["MANIFEST.json", f"{CASE}.arrow"]}))
    return gdir


def _staged_onto_case(work: Path) -> Path:
    """A staged file of the journal's own transaction, renamed onto the live case though the manifest it
    commits lists other bytes for that file."""
    name = store.staged_name(f"{CASE}.arrow", TXID)
    return journal(work, renames=[[name, f"{CASE}.arrow"]], staged={name: b"not the golden"})


def _staged_tampered(work: Path) -> Path:
    """A staged file whose bytes no longer match the sha256 its journal records."""
    name = store.staged_name(f"{CASE}.arrow", TXID)
    return journal(work, renames=[[name, f"{CASE}.arrow"]], staged={name: b"new golden bytes"}, tampered=True)


def _case(work: Path, key: str, value: object) -> Path:
    return edit_manifest(work, lambda o: o["cases"][CASE]["provenance"].update({key: value}))


def _manifest_is_directory(work: Path) -> Path:
    gdir = golden_dir(work)
    (gdir / "MANIFEST.json").unlink()
    (gdir / "MANIFEST.json").mkdir()
    return gdir


def _trace_is_directory(work: Path) -> Path:
    gdir = golden_dir(work)
    (gdir / f"{CASE}.arrow").unlink()
    (gdir / f"{CASE}.arrow").mkdir()
    return gdir


def _loop(work: Path) -> Path:
    (work / "g").symlink_to(work / "g")
    return work / "g"


def _forged_case(work: Path) -> Path:
    """A manifest whose case name holds a newline and an error line of its own (its file missing, so that
    verify names the case in its error)."""
    def add(o: dict) -> None:
        o["cases"][FORGED] = {**o["cases"][CASE], "file": "missing.arrow"}
    return edit_manifest(work, add)


# ------------------------------------------------------------------------------ the entries
_ADD = ["--reason", "r", "--expect", "fail:logits", "--allow-unsupported", "kv,conv,recurrent"]
_LEFT_ALONE = r"it was left alone \(nothing was renamed or deleted\)"

CASES: list[Bad] = [
    # ---- the journal: obeyed only when it is its own transaction's
    Bad("golden-journal-old-format-deletes", "golden", lambda w: ["golden", "verify", "--golden", str(_old_journal(w))],
        EXIT_CORRUPT, r"golden journal .* is malformed \(not a version 2 journal.*" + _LEFT_ALONE),
    Bad("golden-journal-deletes-live-case", "golden", lambda w: ["golden", "verify", "--golden", str(journal(w, deletes=[f"{CASE}.arrow"]))],
        EXIT_CORRUPT, rf"deletes {CASE}\.arrow, which is neither a case its manifest records as removed.*" + _LEFT_ALONE),
    Bad("golden-journal-deletes-manifest", "golden", lambda w: ["golden", "verify", "--golden", str(journal(w, deletes=["MANIFEST.json"]))],
        EXIT_CORRUPT, r"deletes MANIFEST\.json, which is neither.*" + _LEFT_ALONE),
    Bad("golden-journal-renames-golden-onto-golden", "golden", lambda w: ["golden", "remove", CASE, "--reason", "r", "--golden",
                                                                           str(journal(w, renames=[[f"{CASE}.arrow", "other.arrow"]]))],
        EXIT_CORRUPT, rf"renames {CASE}\.arrow onto other\.arrow, not a staged trace of its transaction"),
    Bad("golden-journal-staged-not-in-manifest", "golden", lambda w: ["golden", "verify", "--golden", str(_staged_onto_case(w))],
        EXIT_CORRUPT, rf"the manifest it commits does not list {CASE}\.arrow with that sha256.*" + _LEFT_ALONE),
    Bad("golden-journal-manifest-unverifiable", "golden", lambda w: ["gate", str(journal(w, manifest_sha="0" * 64))],
        EXIT_CORRUPT, r"cannot be verified: neither \.MANIFEST\.json\.0123456789ab\.staged nor MANIFEST\.json holds"),
    Bad("golden-journal-staged-tampered", "golden", lambda w: ["golden", "verify", "--golden", str(_staged_tampered(w))],
        EXIT_CORRUPT, rf"cannot be verified: neither \.{CASE}\.arrow\.{TXID}\.staged nor {CASE}\.arrow holds the bytes"),
    Bad("golden-journal-new-case-not-in-manifest", "golden", lambda w: ["golden", "verify", "--golden", str(journal(
        w, renames=[[store.staged_name("new.arrow", TXID), "new.arrow"]], staged={store.staged_name("new.arrow", TXID): b"x"}))],
        EXIT_CORRUPT, r"does not list new\.arrow with that sha256"),
    # ---- manifest validation: one line naming the file, the case and the key
    Bad("manifest-triaged-not-object", "golden", lambda w: ["golden", "verify", "--golden", str(_case(w, "triaged", [1]))],
        EXIT_CORRUPT, rf"MANIFEST\.json case '{CASE}': provenance triaged\[0\] is 1, expected"),
    Bad("manifest-allow-unsupported-int", "golden", lambda w: ["gate", str(_case(w, "allow_unsupported", 5))],
        EXIT_CORRUPT, rf"MANIFEST\.json case '{CASE}': provenance allow_unsupported is 5, expected a list"),
    Bad("manifest-expect-first-garbage", "golden", lambda w: ["golden", "verify", "--golden", str(_case(w, "expect_first", "garbage"))],
        EXIT_CORRUPT, rf"MANIFEST\.json case '{CASE}': provenance expect_first is 'garbage', expected null or"),
    Bad("manifest-expect-not-text", "golden", lambda w: ["golden", "verify", "--golden", str(_case(w, "expect", ["fail"]))],
        EXIT_CORRUPT, r"provenance expect is \['fail'\], expected 'pass', 'fail' or 'fail:CATEGORY'"),
    Bad("manifest-version-zero", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(w, lambda o: o.update(version=0)))],
        EXIT_CORRUPT, r"MANIFEST\.json: 'version' is 0, not a manifest version"),
    Bad("manifest-bytes-negative", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(
        w, lambda o: o["cases"][CASE].update(bytes=-5)))], EXIT_CORRUPT, rf"MANIFEST\.json case '{CASE}': 'bytes' is -5, not a size"),
    Bad("manifest-unknown-top-key", "golden", lambda w: ["golden", "remove", CASE, "--reason", "r", "--golden", str(edit_manifest(
        w, lambda o: o.update(notes="kept?")))], EXIT_CORRUPT, r"MANIFEST\.json: unknown key 'notes' \(known: version, cases, removed\)"),
    Bad("manifest-unknown-case-key", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(
        w, lambda o: o["cases"][CASE].update(owner="me")))], EXIT_CORRUPT, rf"MANIFEST\.json case '{CASE}': unknown key 'owner'"),
    Bad("manifest-removed-unknown-key", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(
        w, lambda o: o.update(removed=[{"case": "old", "reason": "r", "time": "t", "entry": o["cases"][CASE], "by": "me"}])))],
        EXIT_CORRUPT, r"MANIFEST\.json removed\[0\]: unknown key 'by'"),
    Bad("manifest-sha-not-hex", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(
        w, lambda o: o["cases"][CASE].update(sha256="nope")))], EXIT_CORRUPT, r"'sha256' is 'nope', not a hex sha256"),
    Bad("manifest-two-cases-one-file", "golden", lambda w: ["golden", "remove", "twin", "--reason", "r", "--golden", str(edit_manifest(
        w, lambda o: o["cases"].update(twin=o["cases"][CASE])))], EXIT_CORRUPT, rf"both name file '{CASE}\.arrow'"),
    Bad("manifest-is-directory", "golden", lambda w: ["golden", "verify", "--golden", str(_manifest_is_directory(w))],
        EXIT_CORRUPT, r"MANIFEST\.json is a directory, not a manifest file"),
    Bad("golden-file-is-directory", "golden", lambda w: ["golden", "verify", "--golden", str(_trace_is_directory(w))],
        EXIT_CORRUPT, rf"{CASE}: {CASE}\.arrow is a directory, not a trace file"),
    Bad("golden-dir-symlink-loop", "golden", lambda w: ["golden", "verify", "--golden", str(_loop(w))],
        EXIT_CORRUPT, r"the golden directory .*/g is a symbolic link loop"),
    Bad("golden-remove-symlink-loop", "golden", lambda w: ["golden", "remove", CASE, "--reason", "r", "--golden", str(_loop(w))],
        EXIT_USAGE, r"golden directory .*/g: .*/g is a symbolic link loop; nothing was changed"),
    # ---- add, remove and regen arguments: refused before any work
    Bad("golden-add-empty-reason", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", *_ADD[:1], "",
                                                         *_ADD[2:], "--golden", str(w / "g")],
        EXIT_USAGE, r"golden add needs --reason"),
    Bad("golden-add-blank-reason", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", "--reason", "  ",
                                                         "--golden", str(w / "g")], EXIT_USAGE, r"golden add needs --reason"),
    Bad("golden-regen-duplicate-case", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--case", "hybrid-b1",
                                                             "--accept", "--reason", "r", "--golden", str(w / "g")],
        EXIT_USAGE, r"--case hybrid-b1 is given more than once"),
    Bad("golden-regen-empty-reason", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--accept", "--reason", " ",
                                                           "--golden", str(w / "g")], EXIT_USAGE, r"--reason is empty"),
    Bad("golden-regen-missing-parent", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--golden", str(w / "no" / "g")],
        EXIT_USAGE, r"golden directory .*/no/g does not exist, nor does its parent .*/no; nothing was changed"),
    Bad("golden-regen-pending-under-file", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--golden",
                                                                 str(write(w, "f", "x") / "g")],
        EXIT_USAGE, r"/f is not a directory"),
    Bad("golden-regen-corrupt-manifest", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--accept", "--reason", "r",
                                                               "--golden", str(_case(w, "triaged", [1]))],
        EXIT_CORRUPT, r"provenance triaged\[0\] is 1"),
    Bad("golden-add-into-manifest-directory", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", *_ADD,
                                                                    "--golden", str(_manifest_is_directory(w))],
        EXIT_CORRUPT, r"MANIFEST\.json is a directory"),
    # ---- names with control characters: refused when added, printed escaped when read
    Bad("golden-add-newline-name", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", FORGED, *_ADD,
                                                         "--golden", str(w / "g")],
        EXIT_USAGE, r"case name 'x\\nrefcheck: error: forged' is not a plain name"),
    Bad("golden-add-nul-name", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "a\0b", *_ADD, "--golden", str(w / "g")],
        EXIT_USAGE, r"case name 'a\\x00b' is not a plain name"),
    Bad("golden-remove-newline-name", "golden", lambda w: ["golden", "remove", FORGED, "--reason", "r", "--golden", str(golden_dir(w))],
        EXIT_USAGE, r"case name 'x\\nrefcheck: error: forged' is not a plain name"),
    Bad("manifest-newline-case-name", "golden", lambda w: ["golden", "verify", "--golden", str(_forged_case(w))],
        EXIT_CORRUPT, r"case name 'x\\nrefcheck: error: forged' is not a plain name"),
]
