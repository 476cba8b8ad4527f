"""refcheck.sglang.vocab_rows: vocabulary-wide reductions in row chunks, and the capture's reductions through them
(the verify's node summary, the drafter's top ranks) giving the whole call's result row for row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcheck.sglang import vocab_rows
from refcheck.sglang.capture.steps import NodeSummary, _summary, node_logprobs, summarise_nodes
from refcheck.sglang.draft_side import DRAFT_MARGIN, draft_top


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 300), vocab=st.integers(1, 5000), chunk=st.integers(1, 1 << 16))
def test_chunks_cover_the_rows_in_order_within_the_byte_bound(rows, vocab, chunk):
    chunks = vocab_rows.row_chunks(rows, vocab, chunk)
    covered = [i for s in chunks for i in range(s.start, s.stop)]
    assert covered == list(range(rows))
    per = max(1, chunk // (4 * vocab))
    assert all(1 <= s.stop - s.start <= per for s in chunks) or (rows == 0 and chunks == [slice(0, 0)])
    if rows:
        assert all(s.stop - s.start == per for s in chunks[:-1])  # only the last chunk is short


def test_the_default_bound_is_read_at_call_time(monkeypatch):
    """A 16-token block of 32 requests at a 248k vocabulary: 8 chunks under 64 MiB, of 67 rows but the last; one
    chunk at the built-in pair's 512-token vocabulary."""
    assert [s.stop - s.start for s in vocab_rows.row_chunks(512, 248_320)] == [67] * 7 + [43]
    assert vocab_rows.row_chunks(512, 512) == [slice(0, 512)]
    monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * 512 * 100)
    assert len(vocab_rows.row_chunks(512, 512)) == 6


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
def test_the_node_summary_in_chunks_is_the_whole_calls(monkeypatch, chunk_rows):
    rows, vocab = 37, 300
    logits = _logits(rows, vocab)
    picks = torch.randint(-2, vocab + 2, (rows,), generator=torch.Generator().manual_seed(1))  # some outside
    whole = _summary(logits, picks, 5, node_logprobs(logits))
    monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * vocab * chunk_rows)
    for p in (picks, None):
        got = summarise_nodes(logits, p)
        want = whole if p is not None else NodeSummary(whole.topk_ids, whole.topk_logprobs, whole.argmax,
                                                       torch.full((rows,), float("nan")))
        for name, t in got.tensors().items():
            assert torch.equal(t.isnan(), want.tensors()[name].isnan()), name
            torch.testing.assert_close(t, want.tensors()[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_the_drafts_top_ranks_in_chunks_are_the_whole_calls(monkeypatch, chunk_rows):
    """[bs, B-1, V] scores (bf16, as the drafter's head gives them): ids, log-probs and reach per depth equal the
    unchunked reduction's, whose shapes they keep; no rows keeps the shapes too."""
    scores = _logits(3 * 7, 400, seed=2).to(torch.bfloat16).view(3, 7, 400)  # [bs*(B-1), V] -> [bs, B-1, V]
    whole = draft_top(scores, 8)
    monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * 400 * chunk_rows)
    got = draft_top(scores, 8)
    assert got["ids"].shape == (3, 7, 8 + DRAFT_MARGIN) and got["reach"].shape == (3, 7) and got["k"].dim() == 0
    for name in whole:
        assert torch.equal(got[name], whole[name]), name
    empty = draft_top(torch.empty(0, 7, 400), 8)
    assert empty["ids"].shape == (0, 7, 8 + DRAFT_MARGIN) and empty["reach"].shape == (0, 7)


@pytest.mark.parametrize("chunk_pairs", [1, 5, 10_000])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]])
def test_the_recurrent_sketch_in_chunks_of_layer_request_pairs_is_the_whole_product(monkeypatch, chunk_pairs, rows):
    """batch_state's ``rec`` ``[L, b, r]``: the recorded layers' rows (all, or some in another order) by the
    requests' slots, projected in chunks of (layer, request) pairs, equal one product over the whole gathered state;
    ``full`` rows (recurrent and conv) are those layers' rows of those slots."""
    from refcheck.sglang.capture.state import MambaPools, _ssm_projection, batch_state

    g = torch.Generator().manual_seed(3)
    ssm = torch.randn(3, 6, 2, 4, 4, generator=g)  # [L_pool, slots, HV, V, K]
    pools = MambaPools(layers=[10 + r for r in rows], rows=rows, conv=torch.randn(3, 6, 12, 3, generator=g), ssm=ssm)
    slots = torch.tensor([4, 1, 5, 0])
    kv: dict = {}
    proj = _ssm_projection(2, 4, 4, "cpu").reshape(2 * 4 * 4, -1)  # [HV*V*K, r]
    whole = (ssm[torch.tensor(rows)][:, slots].reshape(len(rows) * 4, -1) @ proj).view(len(rows), 4, -1)
    monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * 2 * 4 * 4 * chunk_pairs)
    got = batch_state(kv, torch.zeros(4, 1, dtype=torch.long), pools, slots, full=True)["mamba"]
    torch.testing.assert_close(got["rec"], whole, rtol=1e-6, atol=1e-6)
    from refcheck.sglang.layout import conv_to_reference, ssm_to_reference

    want_rows = ssm_to_reference(ssm[torch.tensor(rows)][:, slots]).reshape(len(rows), 4, 2, 16)
    assert torch.equal(got["rec_rows"], want_rows)
    assert torch.equal(got["conv_rows"], conv_to_reference(pools.conv[torch.tensor(rows)][:, slots]))
