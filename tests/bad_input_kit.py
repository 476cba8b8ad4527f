"""Builders of the bad-input corpus (tests/test_bad_inputs.py): golden copies, rewritten traces, golden
directories, model copies, prompts files, and :class:`Bad`, one corpus entry. The case modules
(``bad_input_cases_*.py``) and the corpus test share them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from refcheck.goldens import REPO_GOLDEN
from refcheck.goldens.manifest import load_manifest
from refcheck.models import builtin_pair

from trace_helpers import rewrite, rewrite_legacy

ROOT = Path(__file__).resolve().parents[1]
CASE = "zlab-hybrid-chain"  # the smallest real golden (sealed, schema 1.1)


# ------------------------------------------------------------------------------ builders
def golden_file() -> Path:
    return REPO_GOLDEN / load_manifest(REPO_GOLDEN).cases[CASE].file


def trace_copy(work: Path, name: str = "t.arrow") -> Path:
    dst = work / name
    shutil.copy(golden_file(), dst)
    return dst


def write(work: Path, name: str, data: bytes | str) -> Path:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def flipped(work: Path, at: float, bit: int = 2) -> Path:
    data = bytearray(golden_file().read_bytes())
    data[int(len(data) * at)] ^= 1 << bit
    return write(work, "flipped.arrow", bytes(data))


def rewritten(work: Path, table_fn=lambda t: t, meta_fn=lambda m: m, legacy: bool = False) -> Path:
    (rewrite_legacy if legacy else rewrite)(golden_file(), work / "bad.arrow", table_fn=table_fn, meta_fn=meta_fn)
    return work / "bad.arrow"


def set_cell(table: pa.Table, column: str, row: int, fn) -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = fn(values[row])
    i = table.column_names.index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def golden_dir(work: Path, cases: tuple[str, ...] = (CASE,)) -> Path:
    gdir = work / "g"
    gdir.mkdir()
    m = load_manifest(REPO_GOLDEN)
    for c in cases:
        shutil.copy(REPO_GOLDEN / m.cases[c].file, gdir)
    m.cases = {c: m.cases[c] for c in cases}
    m.save(gdir)
    return gdir


def manifest_text(work: Path, text: str) -> Path:
    gdir = golden_dir(work)
    (gdir / "MANIFEST.json").write_text(text)
    return gdir


def edit_manifest(work: Path, fn) -> Path:
    gdir = golden_dir(work)
    obj = json.loads((gdir / "MANIFEST.json").read_text())
    fn(obj)
    (gdir / "MANIFEST.json").write_text(json.dumps(obj))
    return gdir


def model_copy(work: Path, which: str = "target") -> tuple[Path, Path]:
    tdir, ddir = builtin_pair("hybrid")
    t, d = work / "target", work / "draft"
    shutil.copytree(tdir, t)
    shutil.copytree(ddir, d)
    return t, d


def poison_weights(directory: Path, value: float) -> None:
    from safetensors.torch import load_file, save_file

    f = directory / "model.safetensors"
    weights = load_file(str(f))
    name = sorted(k for k, v in weights.items() if v.is_floating_point() and v.dim() == 2)[0]
    weights[name].view(-1)[3] = value
    save_file(weights, str(f), metadata={"format": "pt"})


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def prompts(work: Path, text: str) -> Path:
    return write(work, "p.jsonl", text)


ONE_PROMPT = '{"id": "a", "prompt_ids": [30, 31, 32, 33, 34, 35]}\n'
FAST = ["--max-new-tokens", "3", "--drafter", "scripted"]


def text_run(line: str, drop: tuple[str, ...] = (), corrupt: str | None = None) -> Callable[[Path], list[str]]:
    """``run`` on a copy of the built-in pair whose target directory lost ``drop`` / has ``corrupt`` garbled,
    with a prompts file of one text line."""
    def build(work: Path) -> list[str]:
        t, d = model_copy(work)
        for name in drop:
            (t / name).unlink()
        if corrupt:
            (t / corrupt).write_text("{not a tokenizer")
        return ["run", "--model", str(t), "--draft", str(d), "--max-new-tokens", "2", "--prompts", str(prompts(work, line))]
    return build


@dataclass(frozen=True)
class Bad:
    id: str
    kind: str
    build: Callable[[Path], list[str]]  # makes the inputs under work/, returns the CLI arguments
    code: int
    match: str  # regex the error (or warning) line must match
    writes: str | None = None  # the one directory under work/ the command may change
    env: tuple[tuple[str, str], ...] = ()


def model_run(t_d_mutate: Callable[[Path, Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        t, d = model_copy(work)
        t_d_mutate(t, d)
        return ["run", "--model", str(t), "--draft", str(d), "--max-new-tokens", "2",
                "--prompts", str(prompts(work, ONE_PROMPT))]
    return build
