"""The bad-input and fault corpus: every entry runs the real CLI in-process and must end with its
documented exit code, exactly one error line matching the expected message, no traceback, and no
file changed outside the directory the command may write (nothing at all for a refused command).

Kinds: trace (corrupt or malformed trace files), golden (manifests, golden directories, the store),
option (bad option values), model (checkpoints and draft/target pairs), prompt (prompts files),
output (output paths checked before work, late write failures). ``test_corpus_size`` keeps the
corpus at 140 entries or more and reports the counts by kind.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from bad_input_cases_cli import CASES as CLI_CASES
from bad_input_cases_store import CASES as STORE_CASES
from bad_input_kit import (
    CASE,
    FAST,
    ONE_PROMPT,
    ROOT,
    Bad,
    edit_json,
    edit_manifest,
    flipped,
    golden_dir,
    golden_file,
    manifest_text,
    model_copy,
    model_run,
    poison_weights,
    prompts,
    rewritten,
    set_cell,
    text_run,
    trace_copy,
    write,
)

from refcheck.errors import EXIT_CORRUPT, EXIT_GOLDEN, EXIT_MODEL, EXIT_PASS, EXIT_USAGE
from refcheck.goldens import REPO_GOLDEN, store
from refcheck.trace import schema as trace_schema

# ------------------------------------------------------------------------------ the corpus
CORPUS: list[Bad] = [
    # ---- traces
    Bad("trace-truncated", "trace", lambda w: ["trace", "show", str(write(w, "t.arrow", golden_file().read_bytes()[:-100]))],
        EXIT_CORRUPT, "truncated or corrupt Arrow file"),
    Bad("trace-truncated-half", "trace", lambda w: ["diff", "--against", str(write(w, "t.arrow", golden_file().read_bytes()[: 40000]))],
        EXIT_CORRUPT, "truncated or corrupt"),
    Bad("trace-empty", "trace", lambda w: ["trace", "show", str(write(w, "t.arrow", b""))], EXIT_CORRUPT, "empty trace file"),
    Bad("trace-random", "trace", lambda w: ["diff", "--against", str(write(w, "t.arrow", os.urandom(4096)))],
        EXIT_CORRUPT, r"bad magic"),
    Bad("trace-random-after-magic", "trace", lambda w: ["trace", "show", str(write(w, "t.arrow", b"ARROW1\0\0" + os.urandom(4096)))],
        EXIT_CORRUPT, "truncated or corrupt Arrow file"),
    Bad("trace-renamed-text", "trace", lambda w: ["trace", "show", str(write(w, "notes.arrow", "request_id,step\nx,1\n"))],
        EXIT_CORRUPT, r"bad magic"),
    Bad("trace-newer-schema", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"2.0"}))],
        EXIT_CORRUPT, r"schema version 2\.0 is newer"),
    Bad("trace-unparsable-version", "trace", lambda w: ["trace", "show", str(rewritten(w, meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"one"}))],
        EXIT_CORRUPT, "unparsable schema version"),
    Bad("trace-missing-column", "trace", lambda w: ["diff", "--against", str(rewritten(w, table_fn=lambda t: t.drop_columns(["bonus"])))],
        EXIT_CORRUPT, r"lacks required column\(s\): bonus"),
    Bad("trace-wrong-column-type", "trace", lambda w: ["trace", "show", str(rewritten(w, table_fn=lambda t: t.set_column(
        t.column_names.index("bonus"), "bonus", t.column("bonus").cast(pa.int64()))))], EXIT_CORRUPT, "'bonus' has type int64"),
    Bad("trace-not-refcheck", "trace", lambda w: ["trace", "show", str(rewritten(w, meta_fn=lambda m: {k: v for k, v in m.items() if k != trace_schema.KEY_MAGIC}))],
        EXIT_CORRUPT, "not a refcheck trace"),
    Bad("trace-bad-provenance", "trace", lambda w: ["trace", "show", str(rewritten(w, meta_fn=lambda m: {**m, trace_schema.KEY_PROVENANCE: b"{nope"}))],
        EXIT_CORRUPT, "provenance is not valid JSON"),
    Bad("trace-zero-requests", "trace", lambda w: ["trace", "show", str(rewritten(w, meta_fn=lambda m: {**m, trace_schema.KEY_REQUESTS: b"garbage"}))],
        EXIT_CORRUPT, "requests table is corrupt"),
    Bad("trace-bit-flip-batch", "trace", lambda w: ["diff", "--against", str(flipped(w, 0.5))], EXIT_CORRUPT,
        r"checksum mismatch in record batch 0"),
    Bad("trace-bit-flip-early", "trace", lambda w: ["diff", "--against", str(flipped(w, 0.02))], EXIT_CORRUPT, r"checksum mismatch"),
    Bad("trace-bit-flip-footer", "trace", lambda w: ["trace", "show", str(flipped(w, 0.995))], EXIT_CORRUPT, r"checksum mismatch|corrupt Arrow"),
    Bad("trace-checksums-stripped", "trace", lambda w: ["trace", "show", str(rewritten(w, meta_fn=lambda m: {**m, trace_schema.KEY_VERSION: b"1.1"}, legacy=True))],
        EXIT_CORRUPT, "without its checksums"),
    Bad("trace-parent-out-of-range", "trace", lambda w: ["diff", "--against", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "tree_parents", 3, lambda p: p[:1] + [len(p) + 5] + p[2:])))], EXIT_CORRUPT, r"step \d+ node 1: parent \d+ out of range"),
    Bad("trace-depth-inconsistent", "trace", lambda w: ["trace", "show", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "tree_depths", 2, lambda d: d[:1] + [7] + d[2:])))], EXIT_CORRUPT, r"node 1: depth 7"),
    Bad("explain-malformed-tree", "trace", lambda w: ["explain", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "tree_parents", 0, lambda p: p[:1] + [-4] + p[2:]))), "--request", "code-1", "--step", "0", "--node", "1"],
        EXIT_CORRUPT, r"request '[\w-]+' step 0 node 1: parent -4 out of range"),
    Bad("trace-step-jump", "trace", lambda w: ["diff", "--against", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "step", 1, lambda s: s + 100)))], EXIT_CORRUPT, r"steps must run 0, 1, 2, \.\.\. without gaps"),
    Bad("trace-step-duplicate", "trace", lambda w: ["trace", "show", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "step", 1, lambda s: 0)))], EXIT_CORRUPT, r"has step 0 twice"),
    Bad("trace-accepted-out-of-range", "trace", lambda w: ["trace", "show", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "accepted", 0, lambda a: a + [999])))], EXIT_CORRUPT, r"accepted node indices \[999\] out of range"),
    Bad("trace-token-outside-vocab", "trace", lambda w: ["diff", "--against", str(rewritten(w, table_fn=lambda t: set_cell(
        t, "tree_tokens", 2, lambda x: x[:1] + [10**6] + x[1:][1:])))], EXIT_CORRUPT, r"node 1: tree_tokens 1000000 is outside the vocabulary"),
    Bad("trace-missing-file", "trace", lambda w: ["diff", "--against", str(w / "nope.arrow")], EXIT_GOLDEN, "no trace at"),
    Bad("trace-is-directory", "trace", lambda w: ["trace", "show", str(w)], EXIT_CORRUPT, "cannot read trace"),
    Bad("baseline-corrupt-trace", "trace", lambda w: ["baseline", str(flipped(w, 0.4)), "--source", "ddtree_table1"],
        EXIT_CORRUPT, "checksum mismatch"),
    # ---- goldens and the store
    Bad("manifest-truncated", "golden", lambda w: ["golden", "verify", "--golden", str(manifest_text(w, '{"version": 1, "cas'))],
        EXIT_CORRUPT, "is not valid JSON"),
    Bad("manifest-not-object", "golden", lambda w: ["gate", str(manifest_text(w, "[]"))], EXIT_CORRUPT, "not a JSON object"),
    Bad("manifest-newer", "golden", lambda w: ["golden", "verify", "--golden", str(manifest_text(w, '{"version": 9, "cases": {}}'))],
        EXIT_CORRUPT, "manifest version 9 is newer"),
    Bad("manifest-wrong-sha", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(w, lambda o: o["cases"][CASE].update(sha256="0" * 64)))],
        EXIT_CORRUPT, "sha256 mismatch"),
    Bad("manifest-traversal-file", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(w, lambda o: o["cases"][CASE].update(file="../t.arrow")))],
        EXIT_CORRUPT, "is not a plain file name"),
    Bad("manifest-traversal-case", "golden", lambda w: ["golden", "verify", "--golden", str(edit_manifest(w, lambda o: o["cases"].update({"../x": o["cases"][CASE]})))],
        EXIT_CORRUPT, r"case name '\.\./x' is not a plain name"),
    Bad("manifest-missing", "golden", lambda w: ["golden", "verify", "--golden", str(w)], EXIT_GOLDEN, "no MANIFEST.json"),
    Bad("manifest-empty-cases", "golden", lambda w: ["gate", str(manifest_text(w, '{"version": 1, "cases": {}}'))], EXIT_GOLDEN, "lists no golden traces"),
    Bad("golden-missing", "golden", lambda w: ["golden", "verify", "--golden", str(_unlink(golden_dir(w), CASE))], EXIT_GOLDEN, "is missing"),
    Bad("golden-renamed", "golden", lambda w: ["gate", str(_rename(golden_dir(w), CASE))], EXIT_GOLDEN, "is missing"),
    Bad("golden-extra", "golden", lambda w: ["golden", "verify", "--golden", str(_extra(golden_dir(w)))], EXIT_PASS, "warning: orphan trace extra.arrow"),
    Bad("golden-leftover-staged", "golden", lambda w: ["golden", "verify", "--golden", str(_staged(golden_dir(w)))], EXIT_PASS,
        r"warning: leftover temporary file \.x\.arrow\.0\.staged"),
    Bad("golden-symlink", "golden", lambda w: ["golden", "verify", "--golden", str(_symlinked(w))], EXIT_CORRUPT, "is a symbolic link"),
    Bad("golden-flipped", "golden", lambda w: ["gate", str(_flip_in_dir(golden_dir(w)))], EXIT_CORRUPT, "sha256 mismatch"),
    Bad("golden-add-traversal", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "../../x", "--reason", "r", "--golden", str(w / "g")],
        EXIT_USAGE, r"case name '\.\./\.\./x' is not a plain name"),
    Bad("golden-add-hidden", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", ".x", "--reason", "r", "--golden", str(w / "g")],
        EXIT_USAGE, "is not a plain name"),
    Bad("golden-add-separator", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "a/b", "--reason", "r", "--golden", str(w / "g")],
        EXIT_USAGE, "is not a plain name"),
    Bad("golden-add-absolute", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", str(w / "abs"), "--reason", "r", "--golden", str(w / "g")],
        EXIT_USAGE, "is not a plain name"),
    Bad("golden-add-corrupt", "golden", lambda w: ["golden", "add", str(flipped(w, 0.5)), "--case", "x", "--reason", "r", "--golden", str(w / "g")],
        EXIT_CORRUPT, "checksum mismatch"),
    Bad("golden-add-missing", "golden", lambda w: ["golden", "add", str(w / "nope.arrow"), "--case", "x", "--reason", "r", "--golden", str(w / "g")],
        EXIT_GOLDEN, "no trace at"),
    Bad("golden-add-bad-expect", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", "--reason", "r", "--expect", "maybe", "--golden", str(w / "g")],
        EXIT_USAGE, "--expect must be"),
    Bad("golden-add-bad-triage", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", "--reason", "r", "--triage", "nope", "--golden", str(w / "g")],
        EXIT_USAGE, "expected REQUEST:STEP:NODE:CATEGORY"),
    Bad("golden-add-into-file", "golden", lambda w: ["golden", "add", str(trace_copy(w)), "--case", "x", "--reason", "r", "--golden", str(write(w, "f", "x") / "g")],
        EXIT_USAGE, "is not a directory"),
    Bad("golden-remove-traversal", "golden", lambda w: ["golden", "remove", "../" + CASE, "--reason", "r", "--golden", str(golden_dir(w))],
        EXIT_USAGE, "is not a plain name"),
    Bad("golden-remove-unknown", "golden", lambda w: ["golden", "remove", "nosuch", "--reason", "r", "--golden", str(golden_dir(w))],
        EXIT_GOLDEN, "no golden case 'nosuch' to remove"),
    Bad("golden-remove-locked", "golden", lambda w: ["golden", "remove", CASE, "--reason", "r", "--golden", str(golden_dir(w))],
        EXIT_GOLDEN, "is locked by another writer", env=((store.LOCK_TIMEOUT_ENV, "0.2"),)),
    Bad("golden-journal-corrupt", "golden", lambda w: ["golden", "verify", "--golden", str(_journal(golden_dir(w)))], EXIT_CORRUPT,
        "golden journal .* is malformed"),
    Bad("golden-regen-unknown", "golden", lambda w: ["golden", "regen", "--case", "nosuch", "--golden", str(w / "g")], EXIT_USAGE,
        "unknown golden case"),
    Bad("golden-regen-unwritable", "golden", lambda w: ["golden", "regen", "--case", "hybrid-b1", "--accept", "--golden", str(write(w, "f", "x") / "g")],
        EXIT_USAGE, "is not a directory"),
    Bad("gate-unknown-case", "golden", lambda w: ["gate", str(golden_dir(w)), "--case", "nosuch"], EXIT_GOLDEN, "no golden trace for case"),
    # ---- options
    Bad("device-tpu", "option", lambda w: ["run", "--device", "tpu"], EXIT_USAGE, "unknown device 'tpu'"),
    Bad("ref-device-tpu", "option", lambda w: ["diff", "--against", str(trace_copy(w)), "--ref-device", "tpu"], EXIT_USAGE, "unknown device"),
    Bad("device-cuda-absent", "option", lambda w: ["run", "--device", "cuda", *FAST], EXIT_USAGE, "no CUDA device is available"),
    Bad("budget-abc", "option", lambda w: ["run", "--budget", "abc"], EXIT_USAGE, "budget must be a non-negative integer"),
    Bad("budget-negative", "option", lambda w: ["run", "--budget", "-1"], EXIT_USAGE, "budget must be"),
    Bad("budget-huge", "option", lambda w: ["run", "--budget", "100000", *FAST], EXIT_USAGE,
        r"--budget 100000: a tree of 100001 nodes .* context of 2048"),
    Bad("baseline-budget-abc", "option", lambda w: ["baseline", str(trace_copy(w)), "--budget", "abc"], EXIT_USAGE, "--budget must be a non-negative integer"),
    Bad("baseline-rtol-nan", "option", lambda w: ["baseline", str(trace_copy(w)), "--rtol", "nan"], EXIT_USAGE, "--rtol must be a finite number"),
    Bad("baseline-rtol-negative", "option", lambda w: ["baseline", str(trace_copy(w)), "--rtol", "-0.5"], EXIT_USAGE, "--rtol must be"),
    Bad("baseline-no-match", "option", lambda w: ["baseline", str(trace_copy(w)), "--model", "NoSuchModel-1B"], EXIT_USAGE, "no baseline matches"),
    Bad("max-new-tokens-zero", "option", lambda w: ["run", "--max-new-tokens", "0"], EXIT_USAGE, "max-new-tokens"),
    Bad("dtype-unknown", "option", lambda w: ["run", "--dtype", "float8"], EXIT_USAGE, "dtype"),
    Bad("pair-unknown", "option", lambda w: ["run", "--pair", "bogus"], EXIT_USAGE, "pair"),
    Bad("stop-ids-bad", "option", lambda w: ["run", "--stop", "a,b", *FAST], EXIT_USAGE, "--stop must be comma-separated token ids"),
    Bad("engine-unknown", "option", lambda w: ["diff", "--engine", "vllm"], EXIT_USAGE, "unknown engine"),
    Bad("mode-unknown", "option", lambda w: ["diff", "--mode", "bogus"], EXIT_USAGE, "mode"),
    Bad("explain-unknown-request", "option", lambda w: ["explain", str(trace_copy(w)), "--request", "nosuch", "--step", "0", "--node", "0"],
        EXIT_USAGE, "no request 'nosuch'"),
    Bad("explain-node-out-of-range", "option", lambda w: ["explain", str(trace_copy(w)), "--request", "code-1", "--step", "0", "--node", "999"],
        EXIT_USAGE, "not 999"),
    Bad("workers-zero", "option", lambda w: ["gate", "--workers", "0"], EXIT_USAGE, "workers"),
    # ---- models
    Bad("model-missing-dir", "model", lambda w: ["run", "--model", str(w / "nope"), "--draft", str(w / "nope2")], EXIT_MODEL,
        "checkpoint directory not found"),
    Bad("model-no-weights", "model", model_run(lambda t, d: (t / "model.safetensors").unlink()), EXIT_MODEL, "no \\*\\.safetensors weights"),
    Bad("model-garbage-safetensors", "model", model_run(lambda t, d: (t / "model.safetensors").write_bytes(os.urandom(5000))),
        EXIT_MODEL, "target weights .* are not a valid safetensors file"),
    Bad("model-truncated-safetensors", "model", model_run(lambda t, d: (t / "model.safetensors").write_bytes(
        (t / "model.safetensors").read_bytes()[:2000])), EXIT_MODEL, "not a valid safetensors file|cannot load target"),
    Bad("model-bad-config", "model", model_run(lambda t, d: (t / "config.json").write_text("{oops")), EXIT_MODEL, "malformed config.json"),
    Bad("model-unsupported-type", "model", model_run(lambda t, d: edit_json(t / "config.json", lambda c: c.update(model_type="llama"))),
        EXIT_MODEL, "model type 'llama' is not supported"),
    Bad("model-nan-weights", "model", model_run(lambda t, d: poison_weights(t, float("nan"))), EXIT_MODEL,
        r"target model .*: tensor \S+ holds 1 NaN and 0 Inf values"),
    Bad("model-inf-weights", "model", model_run(lambda t, d: poison_weights(t, float("inf"))), EXIT_MODEL, r"holds 0 NaN and 1 Inf"),
    Bad("draft-nan-weights", "model", model_run(lambda t, d: poison_weights(d, float("nan"))), EXIT_MODEL, r"draft model .*: tensor \S+ holds 1 NaN"),
    Bad("draft-garbage-safetensors", "model", model_run(lambda t, d: (d / "model.safetensors").write_bytes(b"\x08" + os.urandom(300))),
        EXIT_MODEL, "draft weights .* are not a valid safetensors file"),
    Bad("draft-other-layer-count", "model", model_run(lambda t, d: edit_json(d / "config.json", lambda c: (
        c["dflash_config"].update(num_target_layers=4, target_layer_ids=[1, 2]), c.update(num_target_layers=4)))),
        EXIT_MODEL, "was made for a 4-layer target; this target has 6 layers"),
    Bad("draft-layer-ids-out-of-range", "model", model_run(lambda t, d: edit_json(d / "config.json", lambda c: c["dflash_config"].update(
        target_layer_ids=[1, 9]))), EXIT_MODEL, r"target_layer_ids \[9\] outside the target's 6 layers"),
    Bad("draft-other-width", "model", model_run(lambda t, d: edit_json(d / "config.json", lambda c: c.update(hidden_size=96))),
        EXIT_MODEL, "draft hidden size 96 != target hidden size 128"),
    Bad("draft-other-vocab", "model", model_run(lambda t, d: edit_json(d / "config.json", lambda c: c.update(vocab_size=1024))),
        EXIT_MODEL, "draft vocab size 1024 != target vocab size 512"),
    Bad("draft-missing", "model", lambda w: ["run", "--model", str(model_copy(w)[0])], EXIT_USAGE, "without --draft"),
    # ---- prompts
    Bad("prompts-missing", "prompt", lambda w: ["run", "--prompts", str(w / "nope.jsonl")], EXIT_USAGE, "prompts file not found"),
    Bad("prompts-not-json", "prompt", lambda w: ["run", "--prompts", str(prompts(w, "{oops\n"))], EXIT_USAGE, r"p\.jsonl:1: not JSON"),
    Bad("prompts-empty", "prompt", lambda w: ["run", "--prompts", str(prompts(w, ""))], EXIT_USAGE, "holds no prompts"),
    Bad("prompts-bad-ids", "prompt", lambda w: ["run", "--prompts", str(prompts(w, '{"id": "a", "prompt_ids": [-3]}\n'))], EXIT_USAGE,
        "non-negative integers"),
    Bad("prompts-repeated-id", "prompt", lambda w: ["run", "--prompts", str(prompts(w, ONE_PROMPT * 2))], EXIT_USAGE, "repeats prompt ids"),
    Bad("prompts-outside-vocab", "prompt", lambda w: ["run", "--prompts", str(prompts(w, '{"id": "a", "prompt_ids": [1, 99999]}\n')), *FAST],
        EXIT_USAGE, r"token id out of range \[0, 512\)"),
    Bad("prompts-text-no-tokenizer", "prompt", text_run('{"id": "a", "prompt": "The quiet river"}\n', drop=("tokenizer.json",)),
        EXIT_USAGE, r"has no tokenizer \(tokenizer\.json or tokenizer_config\.json\)"),
    Bad("prompts-chat-no-template", "prompt", text_run('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'),
        EXIT_USAGE, "has no chat template"),
    Bad("prompts-text-and-ids", "prompt", lambda w: ["run", "--prompts", str(prompts(w, '{"id": "a", "prompt": "x", "prompt_ids": [3]}\n'))],
        EXIT_USAGE, "give exactly one of 'prompt_ids'"),
    Bad("prompts-text-empty", "prompt", lambda w: ["run", "--prompts", str(prompts(w, '{"id": "a", "prompt": ""}\n'))],
        EXIT_USAGE, "'prompt' must be non-empty text"),
    Bad("prompts-messages-malformed", "prompt", lambda w: ["run", "--prompts", str(prompts(w, '{"id": "a", "messages": [{"role": 1}]}\n'))],
        EXIT_USAGE, "'messages' must be a non-empty list"),
    Bad("prompts-bad-tokenizer-file", "prompt", text_run('{"id": "a", "prompt": "The quiet river"}\n',
                                                            corrupt="tokenizer.json"),
        EXIT_USAGE, "is not a tokenizer file"),
    # ---- output paths
    Bad("save-trace-missing-dir", "output", lambda w: ["diff", "--engine", "reference", "--save-trace", str(w / "no" / "t.arrow"), *FAST],
        EXIT_USAGE, "--save-trace .*: directory .* does not exist \\(nothing was run\\)"),
    Bad("save-trace-is-dir", "output", lambda w: ["diff", "--engine", "reference", "--save-trace", str(w), *FAST],
        EXIT_USAGE, "is a directory, not a file"),
    Bad("save-trace-under-file", "output", lambda w: ["diff", "--engine", "reference", "--save-trace", str(write(w, "f", "x") / "t.arrow"), *FAST],
        EXIT_USAGE, "is not a directory"),
    Bad("sweep-out-is-file", "output", lambda w: ["sweep", "--out", str(write(w, "f", "x")), "--budgets", "1", "--no-plots", *FAST],
        EXIT_USAGE, "--out .* is a file, not a directory"),
    Bad("sweep-out-under-file", "output", lambda w: ["sweep", "--out", str(write(w, "f", "x") / "o"), "--budgets", "1", "--no-plots", *FAST],
        EXIT_USAGE, "is not a directory"),
] + STORE_CASES + CLI_CASES


def _unlink(gdir: Path, case: str) -> Path:
    (gdir / f"{case}.arrow").unlink()
    return gdir


def _rename(gdir: Path, case: str) -> Path:
    (gdir / f"{case}.arrow").rename(gdir / "renamed.arrow")
    return gdir


def _extra(gdir: Path) -> Path:
    shutil.copy(golden_file(), gdir / "extra.arrow")
    return gdir


def _staged(gdir: Path) -> Path:
    (gdir / ".x.arrow.0.staged").write_bytes(b"x")
    return gdir


def _symlinked(work: Path) -> Path:
    gdir = golden_dir(work)
    (gdir / f"{CASE}.arrow").rename(work / "elsewhere.arrow")
    (gdir / f"{CASE}.arrow").symlink_to(work / "elsewhere.arrow")
    return gdir


def _flip_in_dir(gdir: Path) -> Path:
    path = gdir / f"{CASE}.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    return gdir


def _journal(gdir: Path) -> Path:
    (gdir / store.JOURNAL_NAME).write_text('{"txid": 1}')
    return gdir


# ------------------------------------------------------------------------------ the runner
def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> a fingerprint of its content (links by target, files by sha256)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def _repo_snapshot() -> dict[str, tuple[int, int]]:
    paths = list(REPO_GOLDEN.iterdir()) + list(ROOT.iterdir())
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths if not p.is_symlink() and p.name != ".git"}


def _hold_lock(gdir: Path) -> Callable[[], None]:
    fd = os.open(gdir, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return lambda: os.close(fd)


@pytest.mark.parametrize("bad", CORPUS, ids=[b.id for b in CORPUS])
def test_bad_input(bad: Bad, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    args = bad.build(work)
    for key, value in bad.env:
        monkeypatch.setenv(key, value)
    release = _hold_lock(work / "g") if bad.id.endswith("-locked") else None
    before, repo_before = _snapshot(tmp_path), _repo_snapshot()
    try:
        code, out, err = cli(*args)  # an exception escaping the CLI (a traceback) fails the test here
    finally:
        if release:
            release()
    assert "Traceback" not in err and "Traceback" not in out
    assert code == bad.code, f"exit {code}, expected {bad.code}: {err[-800:]}"
    lines = [line for line in err.splitlines() if line.startswith(("refcheck: error:", "Error:", "warning:"))]
    errors = [line for line in lines if not line.startswith("warning:")]
    if bad.code != EXIT_PASS:
        assert len(errors) == 1, f"want one error line, got: {err[-800:]}"
    assert any(re.search(bad.match, line) for line in lines), f"no line matches {bad.match!r}: {err[-800:]}"
    after = _snapshot(tmp_path)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    allowed = f"work/{bad.writes}" if bad.writes else None
    assert all(allowed and p.startswith(allowed) for p in changed), f"files changed: {sorted(changed)}"
    assert _repo_snapshot() == repo_before, "the repository's goldens or root changed"


def test_late_save_trace_failure_keeps_the_report(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--save-trace passes the pre-check, then the disk fills: the report still prints, then exit 2."""
    import errno

    from refcheck.trace import io as trace_io

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trace_io, "write_trace", full)
    p = prompts(tmp_path, ONE_PROMPT)
    code, out, err = cli("diff", "--engine", "reference", "--save-trace", str(tmp_path / "t.arrow"), "--prompts", str(p),
                         "--json", *FAST)
    assert code == EXIT_USAGE and "Traceback" not in err
    assert "No space left on device" in err and "the report above is complete" in err
    assert json.loads(out)["reports"][0]["verdict"] == "pass"  # the report came out before the error
    assert not (tmp_path / "t.arrow").exists()


def test_corpus_size() -> None:
    kinds = collections.Counter(b.kind for b in CORPUS)
    assert len(CORPUS) >= 140 and len({b.id for b in CORPUS}) == len(CORPUS), kinds
    assert set(kinds) == {"trace", "golden", "option", "model", "prompt", "output"}, kinds
