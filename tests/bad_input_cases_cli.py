"""Bad-input corpus entries of the command line, traces' provenance, prompts, output paths and workers, joined to the corpus by
tests/test_bad_inputs.py (builders: tests/bad_input_kit.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from bad_input_kit import (
    FAST,
    ONE_PROMPT,
    Bad,
    golden_dir,
    model_copy,
    model_run,
    prompts,
    rewritten,
    trace_copy,
    write,
)

from refcheck.errors import EXIT_CORRUPT, EXIT_GOLDEN, EXIT_MODEL, EXIT_USAGE
from refcheck.trace import schema as trace_schema

FORGED = "x\nrefcheck: error: forged"  # a name that, printed raw, would start a second error line


# ------------------------------------------------------------------------------ builders
def drop_tensor(which: str, name: str) -> Callable[[Path, Path], None]:
    """A ``model_run`` mutation: tensor ``name`` removed from the target's or the draft's safetensors."""
    def mutate(t: Path, d: Path) -> None:
        from safetensors.torch import load_file, save_file

        f = (t if which == "target" else d) / "model.safetensors"
        weights = load_file(str(f))
        del weights[name]
        save_file(weights, str(f), metadata={"format": "pt"})
    return mutate

def provenance_edit(fn: Callable[[dict], None]) -> Callable[[dict], dict]:
    """A ``meta_fn`` for :func:`bad_input_kit.rewritten` that edits the provenance JSON with ``fn``."""
    def meta(m: dict) -> dict:
        prov = json.loads(m[trace_schema.KEY_PROVENANCE])
        fn(prov)
        return {**m, trace_schema.KEY_PROVENANCE: json.dumps(prov).encode()}
    return meta


def with_stop_ids(ids: list) -> Callable[[dict], None]:
    return lambda p: p["engine"]["settings"].__setitem__("stop_token_ids", ids)


def with_max_new_tokens(n: int) -> Callable[[dict], None]:
    return lambda p: p.__setitem__("max_new_tokens", n)


def fifo(work: Path, name: str) -> Path:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def link_to_dev_null(work: Path) -> Path:
    """A link in the work directory to ``/dev/null`` (a character device, not replaced by the test if refcheck
    wrongly writes there: it would replace the link, not the device)."""
    path = work / "null"
    path.symlink_to("/dev/null")
    return path


def empty_dir(work: Path) -> Path:
    path = work / "empty"
    path.mkdir()
    return path


def calibrate_own(work: Path, *extra: str) -> list[str]:
    t, d = model_copy(work)
    return ["calibrate", "--out", str(work / "cal"), "--model", str(t), "--draft", str(d), "--device", "cpu",
            "--dtype", "float32", "--no-faults", *extra]


LIVE = ["diff", "--engine", "reference", *FAST]


CASES: list[Bad] = [
    # ---- checkpoints: a missing tensor is refused by name, never initialised at random
    Bad("model-target-missing-tensor", "model", model_run(drop_tensor("target", "model.layers.3.mlp.down_proj.weight")),
        EXIT_MODEL, r"target checkpoint .* 1 missing tensor: model\.layers\.3\.mlp\.down_proj\.weight"),
    Bad("model-draft-missing-tensor", "model", model_run(drop_tensor("draft", "fc.weight")),
        EXIT_MODEL, r"missing tensor: fc\.weight"),
    # ---- traces: provenance out of range is a corrupt trace naming the file
    Bad("prov-stop-ids-float", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=provenance_edit(
        with_stop_ids([1.5]))))], EXIT_CORRUPT, r"bad\.arrow: provenance engine\.settings\.stop_token_ids holds 1\.5"),
    Bad("prov-stop-ids-text", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=provenance_edit(
        with_stop_ids(["eos"])))), "--mode", "replay"], EXIT_CORRUPT,
        r"bad\.arrow: provenance engine\.settings\.stop_token_ids holds 'eos'"),
    Bad("prov-stop-ids-ref-shards", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=provenance_edit(
        with_stop_ids([1.5])))), "--mode", "replay", "--ref-shards", "2"], EXIT_CORRUPT,
        r"bad\.arrow: provenance engine\.settings\.stop_token_ids holds 1\.5"),
    Bad("prov-max-new-tokens-huge", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=provenance_edit(
        with_max_new_tokens(10**9)))), "--mode", "free"], EXIT_CORRUPT,
        r"bad\.arrow: provenance max_new_tokens 1000000000: .* exceed the target's context of 2048"),
    Bad("prov-max-new-tokens-huge-ref-shards", "trace", lambda w: ["diff", "--against", str(rewritten(
        w, meta_fn=provenance_edit(with_max_new_tokens(10**9)))), "--mode", "replay", "--ref-shards", "2"], EXIT_CORRUPT,
        r"bad\.arrow: provenance max_new_tokens 1000000000: .* exceed the target's context of 2048"),
    Bad("prov-max-new-tokens-negative", "trace", lambda w: ["diff", "--against", str(rewritten(w, meta_fn=provenance_edit(
        with_max_new_tokens(-3)))), "--mode", "free"], EXIT_CORRUPT, r"bad\.arrow: provenance max_new_tokens is -3"),
    Bad("trace-forged-file-name", "trace", lambda w: ["diff", "--against", str(w / f"{FORGED}.arrow")], EXIT_GOLDEN,
        r"no trace at .*x\\nrefcheck: error: forged\.arrow"),
    # ---- options: what the chosen source would ignore is refused
    Bad("diff-engine-and-against", "option", lambda w: [*LIVE, "--against", str(trace_copy(w))], EXIT_USAGE,
        "--engine reference runs a live engine and --against diffs recorded trace files: give one of them"),
    Bad("diff-against-save-trace", "option", lambda w: ["diff", "--against", str(trace_copy(w)), "--save-trace",
                                                        str(w / "x.arrow")], EXIT_USAGE,
        r"--against diffs recorded trace files, .*: --save-trace would be ignored"),
    Bad("diff-against-model", "option", lambda w: ["diff", "--against", str(trace_copy(w)), "--model", str(empty_dir(w))],
        EXIT_USAGE, r"--against .*: --model would be ignored"),
    Bad("diff-goldens-save-trace", "option", lambda w: ["diff", "--golden", str(golden_dir(w)), "--save-trace",
                                                        str(w / "x.arrow")], EXIT_USAGE,
        r"--save-trace set up a live run, which needs --engine"),
    Bad("diff-engine-golden", "option", lambda w: [*LIVE, "--golden", str(golden_dir(w))], EXIT_USAGE,
        "--golden picks the goldens to diff; with --engine the live run is diffed"),
    Bad("diff-capture-sample-zero", "option", lambda w: ["diff", "--engine", "sglang", "--capture-sample", "0"],
        EXIT_USAGE, r"--capture-sample: capture sampling takes 1 batch in N for N in 1\.\.1000000, got 0"),
    Bad("diff-capture-sample-text", "option", lambda w: ["diff", "--engine", "sglang", "--capture-sample", "16:x"],
        EXIT_USAGE, r"--capture-sample: capture sampling is 'N' or 'N:SEED' with integers, got '16:x'"),
    Bad("diff-capture-sample-reference", "option", lambda w: [*LIVE, "--capture-sample", "4"], EXIT_USAGE,
        r"engine reference takes no capture_sample option"),
    Bad("diff-capture-max-mb-zero", "option", lambda w: ["diff", "--engine", "sglang", "--capture-max-mb", "0"],
        EXIT_USAGE, r"--capture-max-mb takes 1\.\.1073741824 MiB, got 0"),
    Bad("diff-capture-roll-no-budget", "option", lambda w: ["diff", "--engine", "sglang", "--capture-roll"],
        EXIT_USAGE, r"--capture-roll rolls the records within a byte budget: give --capture-max-mb MB"),
    Bad("diff-capture-max-mb-reference", "option", lambda w: [*LIVE, "--capture-max-mb", "4"], EXIT_USAGE,
        r"engine reference takes no capture_max_mb option"),
    Bad("run-stop-negative", "option", lambda w: ["run", "--stop", "-1", *FAST], EXIT_USAGE,
        r"--stop -1: -1 is not a token id"),
    Bad("run-stop-beyond-int32", "option", lambda w: ["run", "--stop", f"2,{2**63}", *FAST], EXIT_USAGE,
        r"--stop 2,9223372036854775808: 9223372036854775808 is not a token id"),
    Bad("calibrate-label-slash", "option", lambda w: calibrate_own(w, "--label", "a/b"), EXIT_USAGE,
        r"--label 'a/b' names the runs' files"),
    Bad("calibrate-label-dotdot", "option", lambda w: calibrate_own(w, "--label", ".."), EXIT_USAGE,
        r"--label '\.\.' names the runs' files"),
    # ---- prompts
    Bad("prompts-id-beyond-int64", "prompt", lambda w: ["run", "--prompts", str(prompts(
        w, '{"id": "a", "prompt_ids": [1, 9223372036854775808]}\n')), *FAST], EXIT_USAGE,
        r"p\.jsonl:1: 'prompt_ids' holds 9223372036854775808, not a token id"),
    Bad("prompts-id-beyond-int32", "prompt", lambda w: ["run", "--prompts", str(prompts(
        w, '{"id": "a", "prompt_ids": [1, 2147483648]}\n')), *FAST], EXIT_USAGE, r"holds 2147483648, not a token id"),
    Bad("prompts-forged-id", "prompt", lambda w: ["run", "--prompts", str(prompts(
        w, json.dumps({"id": FORGED, "prompt_ids": [1, 99999]}) + "\n")), *FAST], EXIT_USAGE,
        r"token id out of range \[0, 512\)"),
    # ---- output paths: a regular file or nothing; special files are refused, never replaced
    Bad("save-trace-fifo", "output", lambda w: [*LIVE, "--prompts", str(prompts(w, ONE_PROMPT)), "--save-trace",
                                               str(fifo(w, "t.arrow"))], EXIT_USAGE,
        r"--save-trace .*t\.arrow is a FIFO, not a regular file"),
    Bad("save-trace-dev-null", "output", lambda w: [*LIVE, "--prompts", str(prompts(w, ONE_PROMPT)), "--save-trace",
                                                   str(link_to_dev_null(w))], EXIT_USAGE,
        r"--save-trace .*null is a character device, not a regular file"),
    Bad("sweep-out-file-fifo", "output", lambda w: ["sweep", "--out", str(fifo(w, "o/sweep.json").parent), "--budgets",
                                                   "1", "--no-plots", *FAST], EXIT_USAGE,
        r"--out .*sweep\.json is a FIFO, not a regular file"),
    Bad("sweep-out-plot-dir", "output", lambda w: ["sweep", "--out", str(write(
        w, "o/sweep_tau_speed.png/x", "x").parents[1]), "--budgets", "1", *FAST], EXIT_USAGE,
        r"--out .*sweep_tau_speed\.png is a directory, not a file"),
    Bad("calibrate-out-is-file", "output", lambda w: ["calibrate", "--out", str(write(w, "f", "x")), "--no-corpus",
                                                     "--no-faults", "--device", "cpu"], EXIT_USAGE,
        r"--out .*f is a file, not a directory"),
    Bad("calibrate-out-fifo-inside", "output", lambda w: ["calibrate", "--out", str(fifo(w, "cal/calibration.md").parent),
                                                         "--no-corpus", "--no-faults", "--device", "cpu"], EXIT_USAGE,
        r"--out .*calibration\.md is a FIFO"),
    Bad("gate-cache-dir-under-file", "output", lambda w: ["gate", str(golden_dir(w)), "--workers", "1", "--cache-dir",
                                                         str(write(w, "f", "x") / "cache")], EXIT_USAGE,
        r"--cache-dir .*cache: .*f is not a directory \(nothing was run\)"),
    Bad("gate-cache-dir-fifo", "output", lambda w: ["gate", str(golden_dir(w)), "--workers", "1", "--cache-dir",
                                                   str(fifo(w, "cache"))], EXIT_USAGE,
        r"--cache-dir .*cache is a FIFO, not a directory"),
]
