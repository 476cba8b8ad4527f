"""The capture's device work replayed from graph caches (refcheck/sglang/capture/graphs.py, committed.py's
bucketing) on the CPU: a state graph serves every batch size up to its bucket, and the hooks record the same
through caches with a CUDA graph's semantics (tests/capture_kit.py: ReplayingCache). The same on the GPU:
tests/test_gpu.py."""

from __future__ import annotations

import torch
from capture_kit import make_scheduler  # tests/capture_kit.py

from refcheck.sglang.capture import hooks
from refcheck.sglang.capture.committed import bucket, bucketed


def test_a_state_graph_serves_every_batch_size_up_to_its_bucket():
    """The state sketch of b requests comes from the graph of the next power of two (refcheck/sglang/capture/
    committed.py: bucket), packed, the first request repeated to fill it: the first b rows of every tensor are the
    sketch of the b requests alone, and the filler rows are the first request's (off CUDA the graph cache runs the
    padded computation as it is)."""
    from refcheck.sglang.capture.graphs import GraphCache
    from refcheck.sglang.capture.state import MambaPools, batch_state

    assert [bucket(b) for b in (1, 2, 3, 4, 5, 17, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]
    sched, kb, conv, temporal = make_scheduler()
    kv = {2: (kb, kb.flip(0))}
    mamba = MambaPools([0], [0], conv[0], temporal)
    table = sched.tp_worker.model_runner.req_to_token_pool.req_to_token
    to_mamba = torch.tensor([0, 4, 2])

    def sketch(rows, lens):
        slots = table[rows[:, None], lens[:, None] + torch.arange(3)]  # [b, 3]
        return batch_state(kv, slots, mamba, to_mamba[rows])

    cache = GraphCache()
    for rows in ([2, 0, 1], [1], [0, 2], [2, 1, 0, 1, 2]):
        r, lens = torch.tensor(rows), torch.tensor([4, 7, 1, 3, 9][: len(rows)])
        b, big = len(rows), bucket(len(rows))
        got, want = bucketed(cache, ("k",), sketch, r, lens).unpacked(), sketch(r, lens)
        for name, entry in want["kv"].items():
            sk = got["kv"][name][2]  # [B, W, r]
            assert sk.shape[0] == big and torch.allclose(sk[:b], entry[2], atol=1e-6)
            assert torch.allclose(sk[b:], entry[2][:1].expand(big - b, *entry[2].shape[1:]), atol=1e-6)
        for kind in ("conv", "rec"):
            m = got["mamba"][kind]  # [L, B, ...]
            assert m.shape[1] == big and torch.allclose(m[:, :b], want["mamba"][kind], atol=1e-6)


def test_the_hooks_record_the_same_through_caches_that_replay_like_cuda_graphs(tmp_path, monkeypatch):
    """The capture hooks' three graph caches (state sketch, verify reductions, DFLASH taps) swapped for
    tests/capture_kit.py's ReplayingCache, which keeps a CUDA graph's semantics on the CPU (the first call's
    closure replayed, outputs written in place, other keys' outputs scribbled over): four DFLASH batches, two of
    them replays of the first two's graphs, record what the eager hooks record. The GPU run of the same batches
    through real CUDA graphs: tests/test_gpu.py."""
    from capture_kit import ReplayingCache, assert_same_records, dflash_batches

    caches = {"_STATE_GRAPHS": ReplayingCache(), "_VERIFY_GRAPHS": ReplayingCache(),
              "_TAP_GRAPHS": (ReplayingCache(), ReplayingCache())}
    for name, cache in caches.items():
        monkeypatch.setattr(hooks, name, cache)
    on = dflash_batches(tmp_path / "on", monkeypatch, graphs=True, dev="cpu")
    assert len(caches["_STATE_GRAPHS"]) == 2 and len(caches["_TAP_GRAPHS"][1]) == 2  # batch sizes 3 and 2
    monkeypatch.undo()
    off = dflash_batches(tmp_path / "off", monkeypatch, graphs=False, dev="cpu")
    assert_same_records(on, off)


def test_a_replaying_cache_catches_a_stale_closure_and_outputs_kept_past_another_replay():
    """tests/capture_kit.py's ReplayingCache fails the two mistakes a CUDA graph punishes: a value handed through
    the closure instead of the inputs (the first call's is replayed) and a graph's outputs read after another
    graph of the same cache replayed."""
    from capture_kit import ReplayingCache

    cache = ReplayingCache()
    x = torch.arange(3.0)
    assert cache.run("k", lambda t, s=2.0: t * s, x).tolist() == [0.0, 2.0, 4.0]
    assert cache.run("k", lambda t, s=5.0: t * s, x).tolist() == [0.0, 2.0, 4.0]  # the first closure, not s=5
    kept = cache.run("k", lambda t: t * 2, x)
    cache.run("other", lambda t: t + 1, x)
    assert torch.isnan(kept).all()


def test_target_only_steps_record_the_same_through_a_cache_that_replays_like_cuda_graphs(tmp_path, monkeypatch):
    """A target-only decode step's node reductions go through the verify graph cache: two steps of two requests
    (the second a replay of the first's graph, with new logits and tokens) and one of one request record, through
    tests/capture_kit.py's ReplayingCache, what the eager hooks record."""
    from capture_kit import ReplayingCache, target_only_batches

    cache = ReplayingCache()
    monkeypatch.setattr(hooks, "_VERIFY_GRAPHS", cache)
    on = target_only_batches(tmp_path / "on", monkeypatch, graphs=True)
    monkeypatch.undo()
    off = target_only_batches(tmp_path / "off", monkeypatch, graphs=False)
    assert len(cache) == 2 and len(on) == len(off) == 5  # batch sizes 2 (twice: a replay) and 1
    for a, b in zip(on, off):
        assert (a.rid, a.tokens, a.topk_ids, a.argmax, a.emitted) == (b.rid, b.tokens, b.topk_ids, b.argmax, b.emitted)
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-6)


def test_a_graph_cache_admits_graphs_within_its_count_and_its_static_bytes():
    """Each graph keeps a copy of its inputs, which at a real vocabulary are a batch's logits: a cache admits a new
    key while it has fewer than ``limit`` graphs and the key's inputs fit in what ``max_bytes`` leaves; a key
    refused runs eagerly from then on, and a smaller key may still fit."""
    from refcheck.sglang.capture.graphs import MAX_STATIC_BYTES, GraphCache

    cache = GraphCache(max_bytes=1000, limit=2)
    big, small = (torch.zeros(200),), (torch.zeros(10),)  # 800 and 40 bytes of float32
    assert cache.admits("a", big)
    cache.static_bytes += 800  # what run() books once it has captured "a"
    assert not cache.admits("b", big) and "b" in cache._eager  # 1 600 > 1 000: "b" runs eagerly from now on
    assert cache.admits("c", small)
    assert GraphCache(limit=0).admits("d", small) is False  # no graph past the limit
    # at a 248 320-token vocabulary, float32 logits of one request's 16-token block: a default cache holds 16
    assert MAX_STATIC_BYTES // (16 * 248_320 * 4) == 16


def test_a_batch_that_records_some_of_its_requests_keeps_their_rows_of_every_packed_graph_output(tmp_path, monkeypatch):
    """Request 1's rid marks a rule that takes none of the four batches: the DFLASH records hold requests 0 and 2 only,
    their drafter top ranks, context, node summaries and state the rows of the same requests recorded with all three
    (each graph's packed output unpacked and cut to the recorded rows)."""
    from capture_kit import dflash_batches

    from refcheck.sglang.capture.sample_rule import SampleRule, sampled_rid

    never = next(SampleRule(1000, seed) for seed in range(100) if not any(SampleRule(1000, seed).takes(g) for g in range(4)))
    full = dflash_batches(tmp_path / "full", monkeypatch, graphs=True, dev="cpu")
    some = dflash_batches(tmp_path / "some", monkeypatch, graphs=True, dev="cpu",
                          rid=lambda i: sampled_rid(never, "r1") if i == 1 else f"r{i}")
    assert [s.rid for s in some] == [s.rid for s in full if s.rid != "r1"]
    for a, b in zip(some, [s for s in full if s.rid != "r1"]):
        assert (a.tokens, a.topk_ids, a.argmax, a.emitted, a.draft_ids, a.context_positions) == \
               (b.tokens, b.topk_ids, b.argmax, b.emitted, b.draft_ids, b.context_positions)
        assert torch.allclose(a.context_sketch, b.context_sketch, atol=1e-6)
        for name in b.state:
            assert torch.allclose(a.state[name][2].float(), b.state[name][2].float(), atol=1e-5), name


class _OnCuda:
    """A stand-in input that says it lives on CUDA (no GPU here): enough for a cache's admission and counts."""

    device = torch.device("cuda")

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 4


def test_a_graph_cache_counts_its_gpu_calls_run_eagerly_until_taken():
    """A key refused (past the cache's bytes) runs eagerly, at its first call and every later one, and is counted
    each time; calls off CUDA are not counted; take_counts hands the counts over and starts again from zero (the
    replays' count on the GPU: tests/test_gpu.py)."""
    from refcheck.sglang.capture.graphs import GraphCache

    cache = GraphCache(max_bytes=100)
    calls = []
    for _ in range(3):
        assert cache.run("big", lambda x: calls.append(x) or "eager", _OnCuda(50)) == "eager"  # 200 bytes > 100
    assert cache.run("cpu", lambda x: "cpu", torch.zeros(1)) == "cpu"
    assert len(calls) == 3 and len(cache) == 0
    assert cache.take_counts() == (0, 3) and cache.take_counts() == (0, 0)


def test_the_hooks_book_their_device_computations_graph_calls_per_recorded_batch(tmp_path, monkeypatch):
    """Four DFLASH batches through caches that replay like CUDA graphs: the ledger books every cache call of a
    recorded batch as replayed (a state sketch, a verify reduction, the draft and the context: four a batch), none
    eager; with any one cache refusing its shape, three replayed and one eager, booked to that cache; with the
    caches off (REFCHECK_CAPTURE_GRAPHS=off), none of either."""
    from capture_kit import ReplayingCache, dflash_batches

    from refcheck.sglang.capture.shipper import GRAPH_CACHES, ledger_summary, read_ledgers

    class Refusing(ReplayingCache):
        def run(self, key, fn, *inputs):
            self.ran_eagerly += 1  # counted as GraphCache counts a key it refused
            return fn(*inputs)

    runs = [(True, None, (4.0, 0.0)), *((True, c, (3.0, 1.0)) for c in GRAPH_CACHES), (False, None, (0.0, 0.0))]
    for graphs, refused, want in runs:
        made = [Refusing() if c == refused else ReplayingCache() for c in GRAPH_CACHES]  # state, verify, draft, context
        caches = {"_STATE_GRAPHS": made[0], "_VERIFY_GRAPHS": made[1], "_TAP_GRAPHS": (made[2], made[3])}
        for name, cache in caches.items():
            monkeypatch.setattr(hooks, name, cache)
        root = tmp_path / f"{graphs}-{refused}"
        dflash_batches(root, monkeypatch, graphs=graphs, dev="cpu")
        ledger = read_ledgers(root)
        cost = ledger_summary(ledger, ledger["written"])
        assert ledger["recorded_batches"] == 4
        assert (cost["graph_replays_per_batch"], cost["graph_eager_per_batch"]) == want, refused
        assert cost["graph_eager_by_cache"] == {c: 1.0 if c == refused else 0.0 for c in GRAPH_CACHES}
