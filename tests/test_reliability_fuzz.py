"""Fuzz of trace mutations through ``refcheck diff --against FILE`` (in-process, the ``cli`` fixture).

Every mutated trace must end with exit 0, 1 or 4 and never a traceback; a trace whose sealed values were
made non-finite (NaN, +Inf, -Inf in the log-prob columns or the state sketches) must never exit 0.

* Byte damage (bit flips, truncation) of the smallest golden (``bad_input_kit.golden_file()``): the file
  carries checksums, so any changed byte is a corrupt trace (exit 4), found before any model work.
* Re-sealed edits (``trace_helpers.rewrite``: the checksums are recomputed, so the reader's integrity check
  passes and the content reaches the diff): non-finite floats, out-of-range token ids, lists one entry too
  long or too short. Their base is the smallest golden that passes (exit 0) and records state sketches,
  ``hybrid-b15``, cut to its first request (13 verify steps, under a second per diff) and given a finite
  layer sketch on every step. (The smallest golden itself, ``zlab-hybrid-chain``, is a known-buggy engine's
  trace that already exits 1: a non-finite value could not turn it into a false pass.)

Examples are derandomized and few: the file runs in under a minute on 2 cores.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from bad_input_kit import golden_file, set_cell
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from refcheck.errors import EXIT_CORRUPT, EXIT_MISMATCH, EXIT_PASS
from refcheck.goldens import REPO_GOLDEN
from refcheck.models import builtin_pair
from refcheck.trace import Trace, decode_tensor, encode_tensor, read_trace, write_trace
from refcheck.trace.schema import KEY_REQUESTS

from trace_helpers import rewrite

BASE_CASE = "hybrid-b15"
VOCAB = int(json.loads((builtin_pair("hybrid")[0] / "config.json").read_text())["vocab_size"])
NONFINITE = (math.nan, math.inf, -math.inf)
BAD_TOKENS = (-1, -(2**31), VOCAB, VOCAB + 1, 2**31 - 1)
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: the columns edited: of the steps table, or of the requests table ("requests.")
FLOAT_COLUMNS = ("topk_logprobs", "draft_topk_logprobs", "emitted_logprobs", "state", "layer_sketch",
                 "requests.output_logprobs")
TOKEN_COLUMNS = ("tree_tokens", "target_argmax", "topk_ids", "draft_topk_ids", "bonus", "emitted",
                 "requests.prompt_ids", "requests.output_ids")
LIST_COLUMNS = ("tree_tokens", "tree_parents", "tree_depths", "tree_ranks", "target_argmax", "accepted",
                "emitted", "emitted_logprobs", "topk_ids", "topk_logprobs", "draft_topk_ids",
                "draft_topk_logprobs", "state", "requests.prompt_ids", "requests.output_ids",
                "requests.output_logprobs")


# ------------------------------------------------------------------------------ the base
def make_base(path: Path) -> Path:
    """``hybrid-b15`` cut to its first request, with a finite layer sketch [layers, N, 4] on every step, at ``path``."""
    trace = read_trace(REPO_GOLDEN / f"{BASE_CASE}.arrow")
    request = trace.requests[0]
    steps = trace.steps_of(request.request_id)
    n_layers = int(json.loads((builtin_pair("hybrid")[0] / "config.json").read_text())["num_hidden_layers"])
    gen = torch.Generator().manual_seed(0)
    for s in steps:
        s.layer_sketch = torch.randn(n_layers, len(s.tree_tokens), 4, generator=gen)
    write_trace(Trace(provenance=trace.provenance, requests=[request], steps=steps), path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base(tmp_path_factory.mktemp("fuzz") / "base.arrow")


def _diff(cli: Callable[..., tuple[int, str, str]], path: Path) -> int:
    code, out, err = cli("diff", "--against", str(path))
    assert "Traceback" not in out + err, err
    assert code in (EXIT_PASS, EXIT_MISMATCH, EXIT_CORRUPT), (code, err[-2000:])
    return code


def test_base_passes(cli, base):
    """The re-sealed edits start from a trace the diff passes: a false pass would show."""
    assert _diff(cli, base) == EXIT_PASS


# ------------------------------------------------------------------------------ byte damage
@settings(FUZZ, max_examples=25)
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=3),
       cut=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)))
def test_damaged_bytes_are_corrupt(cli, tmp_path, flips, cut):
    original = golden_file().read_bytes()
    data = bytearray(original)
    for at, bit in {int(at * len(data)): bit for at, bit in flips}.items():  # one flip per byte: none cancels
        data[at] ^= 1 << bit
    if cut is not None:
        data = data[: int(cut * len(data))]
    assert bytes(data) != original
    (tmp_path / "damaged.arrow").write_bytes(bytes(data))
    assert _diff(cli, tmp_path / "damaged.arrow") == EXIT_CORRUPT


# ------------------------------------------------------------------------------ re-sealed edits
def _leaf(value: Any, pos: int, new: Any) -> Any:
    """``value`` (a scalar, a list or a list of lists) with its ``pos``-th leaf (mod the count) set to ``new``."""
    if not isinstance(value, list):
        return new
    cells = [(i, j) for i, row in enumerate(value) for j in range(len(row))] if value and isinstance(value[0], list) \
        else [(i, None) for i in range(len(value))]
    assert cells, "the base trace has a value at every edited place"
    out = copy.deepcopy(value)
    i, j = cells[pos % len(cells)]
    if j is None:
        out[i] = new
    else:
        out[i][j] = new
    return out


def _in_tensor(encoded: dict[str, Any], pos: int, new: float) -> dict[str, Any]:
    t = decode_tensor(encoded).clone()
    assert t.is_floating_point()
    t.view(-1)[pos % t.numel()] = new
    return encode_tensor(t)


def _set_value(column: str, pos: int, new: Any) -> Callable[[Any], Any]:
    """The cell edit writing ``new`` at leaf ``pos`` of ``column`` (sketch tensors: element ``pos``)."""
    if column == "layer_sketch":
        return lambda v: _in_tensor(v, pos, new)
    if column == "state":
        return lambda v: [dict(e, sketch=_in_tensor(e["sketch"], pos // len(v), new)) if k == pos % len(v) else e
                          for k, e in enumerate(v)]
    return lambda v: _leaf(v, pos, new)


def _resize(grow: bool) -> Callable[[Any], Any]:
    """The cell edit making a list one entry longer (its last repeated) or shorter."""
    return lambda v: (v + v[-1:]) if grow else v[:-1]


def _requests_edit(fn: Callable[[Any], Any], column: str) -> Callable[[dict[bytes, bytes]], dict[bytes, bytes]]:
    def meta_fn(meta: dict[bytes, bytes]) -> dict[bytes, bytes]:
        table = set_cell(pa.ipc.open_stream(meta[KEY_REQUESTS]).read_all(), column, 0, fn)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return {**meta, KEY_REQUESTS: sink.getvalue().to_pybytes()}
    return meta_fn


def _resealed(base: Path, dst: Path, column: str, row: int, fn: Callable[[Any], Any]) -> Path:
    """``base`` with ``fn`` applied to one cell (steps row ``row``, or the request) and sealed again."""
    if column.startswith("requests."):
        rewrite(base, dst, meta_fn=_requests_edit(fn, column.removeprefix("requests.")))
    else:
        rewrite(base, dst, table_fn=lambda t: set_cell(t, column, row % t.num_rows, fn))
    return dst


#: (column, value) pairs the fuzz writes: every float column and non-finite value
NONFINITE_EDITS = [(c, v) for c in FLOAT_COLUMNS for v in NONFINITE]


@settings(FUZZ, max_examples=16)
@given(edit=st.sampled_from(NONFINITE_EDITS), row=st.integers(0, 1 << 16), pos=st.integers(0, 1 << 16))
@example(edit=("topk_logprobs", math.nan), row=0, pos=0)  # each column once, whatever the draws
@example(edit=("draft_topk_logprobs", -math.inf), row=1, pos=3)
@example(edit=("emitted_logprobs", math.inf), row=2, pos=0)
@example(edit=("state", -math.inf), row=3, pos=5)
@example(edit=("requests.output_logprobs", math.nan), row=0, pos=0)
@example(edit=("requests.output_logprobs", math.inf), row=0, pos=3)  # a later token's: checked against its step
@example(edit=("draft_topk_logprobs", math.nan), row=2, pos=1)  # no tree is rebuilt from it; the draft check fails it
def test_nonfinite_values_never_pass(cli, tmp_path, base, edit, row, pos):
    column, value = edit
    path = _resealed(base, tmp_path / "edited.arrow", column, row, _set_value(column, pos, value))
    assert _diff(cli, path) != EXIT_PASS, f"{value} in {column} (row {row}, leaf {pos}) passed the diff"


@settings(FUZZ, max_examples=10)
@given(column=st.sampled_from(TOKEN_COLUMNS), row=st.integers(0, 1 << 16), pos=st.integers(0, 1 << 16),
       token=st.sampled_from(BAD_TOKENS))
def test_out_of_range_token_ids_are_corrupt(cli, tmp_path, base, column, row, pos, token):
    path = _resealed(base, tmp_path / "edited.arrow", column, row, _set_value(column, pos, token))
    assert _diff(cli, path) == EXIT_CORRUPT


@settings(FUZZ, max_examples=12)
@given(column=st.sampled_from(LIST_COLUMNS), row=st.integers(0, 1 << 16), grow=st.booleans())
def test_wrong_list_lengths_end_cleanly(cli, tmp_path, base, column, row, grow):
    _diff(cli, _resealed(base, tmp_path / "edited.arrow", column, row, _resize(grow)))
