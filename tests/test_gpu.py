"""The same reference on CUDA: fp32 exactness, bf16 closeness, CPU == GPU decoding (marker: gpu)."""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from capture_kit import assert_same_records, dflash_batches, tree_and_root_batches  # tests/capture_kit.py

from ddtree_reference.decode import DDTreeDecoder, DecodeConfig
from ddtree_reference.drafter import DFlashDrafter
from ddtree_reference.oracle import greedy_decode, path_logits
from ddtree_reference.scripted import ScriptedDrafter
from ddtree_reference.target import Target
from ddtree_reference.tree import build_ddtree
from refcheck.models import builtin_pair

pytestmark = pytest.mark.gpu
PROMPT = [17, 3, 99, 250, 41, 8, 8, 120, 77, 5, 301, 64]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _tree(target: Target):
    state, fwd = target.prefill(torch.tensor(PROMPT))
    bonus = int(fwd.logits[-1].argmax())
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1, block_size=8,
                              decoy_prob=1.0, max_decoys=1, miss_prob=0.0)
    drafter.extend(fwd.context, torch.arange(len(PROMPT)), torch.tensor(PROMPT))
    return state, build_ddtree(bonus, drafter.propose(bonus, state.length), 24)


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_cuda_fp32_exact_verify(pair):
    target = Target.load(builtin_pair(pair)[0], dtype=torch.float32, device="cuda")
    state, tree = _tree(target)
    fwd = target.forward(state, tree.tokens, tree.parents, tree.depths)
    oracle = path_logits(target.model, PROMPT, tree.tokens.tolist(), tree.parents.tolist())
    # CUDA fp32: the oracle's chunked delta rule (triangular solve) rounds differently from the
    # recurrence; measured 1.0e-5 relative on the H200. A leak is > 1e-2.
    assert float((fwd.logits - oracle).abs().max()) <= 1e-4 * max(1.0, float(oracle.abs().max()))


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_cuda_bf16_verify_deviates_like_transformers_bf16(pair):
    """Three-way calibration: our bf16 tree verify is as far from fp32 as transformers' own bf16."""
    t32 = Target.load(builtin_pair(pair)[0], dtype=torch.float32, device="cuda")
    t16 = Target.load(builtin_pair(pair)[0], dtype=torch.bfloat16, device="cuda")
    state, tree = _tree(t32)
    ref = t32.forward(state, tree.tokens, tree.parents, tree.depths).logits
    s16, _ = t16.prefill(torch.tensor(PROMPT))
    got = t16.forward(s16, tree.tokens, tree.parents, tree.depths).logits
    hf16 = path_logits(t16.model, PROMPT, tree.tokens.tolist(), tree.parents.tolist())
    ours, theirs = float((got - ref).norm() / ref.norm()), float((hf16 - ref).norm() / ref.norm())
    print(f"{pair}: bf16 rel deviation from fp32: reference {ours:.4f}, transformers {theirs:.4f}")
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
@pytest.mark.parametrize("budget", [None, 15, 64])
def test_cuda_fp32_decode_equals_cpu_and_greedy(pair, budget):
    tdir, ddir = builtin_pair(pair)
    outs = []
    for device in ("cpu", "cuda"):
        target = Target.load(tdir, dtype=torch.float32, device=device)
        drafter = DFlashDrafter.load(ddir, target)
        outs.append(DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=32)).generate(PROMPT))
    assert outs[0].output_ids == outs[1].output_ids == greedy_decode(target.model, PROMPT, 32)
    assert outs[0].accept_lengths == outs[1].accept_lengths


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_cuda_bf16_decode_is_lossless_against_bf16_greedy_or_near_tie(pair):
    """bf16 DDTree vs bf16 greedy: equal, or the first difference is a near-tie of the fp32 target."""
    tdir, _ = builtin_pair(pair)
    target = Target.load(tdir, dtype=torch.bfloat16, device="cuda")
    drafter = ScriptedDrafter(target.model, target.vocab_size, target.vocab_size - 1)
    res = DDTreeDecoder(target, drafter, DecodeConfig(budget=15, max_new_tokens=32)).generate(PROMPT)
    ref = greedy_decode(target.model, PROMPT, 32)
    if res.output_ids != ref:
        i = next(k for k, (a, b) in enumerate(zip(res.output_ids, ref)) if a != b)
        t32 = Target.load(tdir, dtype=torch.float32, device="cuda")
        from ddtree_reference.compat import full_forward_logits

        logits = full_forward_logits(t32.model, torch.tensor(PROMPT + ref[:i], device="cuda"))[-1]
        top2 = torch.log_softmax(logits, -1).topk(2).values
        assert float(top2[0] - top2[1]) < 0.05, "bf16 flip at a token that is not a near-tie"


def test_ddtree_builder_on_cuda_equals_cpu():
    """The builder selects the top-k on the log-probs' device: same tree from a CUDA tensor as from CPU."""
    from ddtree_reference.tree import build_ddtree

    g = torch.Generator().manual_seed(3)
    for vocab, ties in ((248320, False), (4096, True)):
        x = torch.randn(15, vocab, generator=g)
        if ties:
            x = (x * 2).round() / 2
        lp = torch.log_softmax(x, -1)
        for budget in (15, 64):
            a, b = build_ddtree(5, lp, budget), build_ddtree(5, lp.cuda(), budget)
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            assert torch.equal(a.scores, b.scores)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("pair", ["hybrid", "attention"])
@pytest.mark.parametrize("budget", [15, 64])
def test_graphed_fixed_shape_step_decodes_like_the_eager_decoder(pair, budget, compiled):
    """The whole reference step as two CUDA graphs (draft; verify + walk + commit + context extend)
    replayed step after step, each step's tree copied into the graph's inputs: the same trees,
    accepted paths, bonus tokens and output as the eager decoder on the same GPU in fp32 — also
    with the target's layers through torch.compile (Target.compile) inside the graphs."""
    from ddtree_reference.graphs import capture
    from ddtree_reference.static import StaticState, verify_walk_commit
    from ddtree_reference.static_draft import StaticDraftContext

    tdir, ddir = builtin_pair(pair)
    target = Target.load(tdir, dtype=torch.float32, device="cuda")
    drafter = DFlashDrafter.load(ddir, target)
    steps, block = 8, drafter.block_size
    ref = DDTreeDecoder(target, drafter, DecodeConfig(budget=budget, max_new_tokens=400)).generate(PROMPT)
    if compiled:  # the eager decoder above is the reference; the graphs below run the compiled layers
        target.compile()
    cap = tuple(drafter.target_layer_ids)
    drafter.reset()
    p = torch.tensor(PROMPT, device="cuda")
    state, fwd = target.prefill(p, capture=cap)
    drafter.extend(fwd.context, torch.arange(len(PROMPT), device="cuda"), p)
    room = len(PROMPT) + (steps + 8) * block
    sstate = StaticState.from_state(state, capacity=room)
    ctx = StaticDraftContext.from_drafter(drafter, capacity=room)
    ins = [torch.zeros(budget + 1, dtype=torch.long, device="cuda") for _ in range(3)]
    bonus = fwd.logits[-1].argmax().clone()
    first = int(bonus)
    snap, ctx_snap = sstate.snapshot(), ctx.snapshot()
    tree0 = build_ddtree(first, drafter.propose(first, len(PROMPT)), budget)
    for dst, src in zip(ins, (tree0.tokens, tree0.parents, tree0.depths)):
        dst.copy_(src)

    def undo():
        sstate.restore(snap)
        ctx.restore(ctx_snap)
        bonus.fill_(first)

    def verify():
        o = verify_walk_commit(target, sstate, *ins, block - 1, cap, ctx)
        bonus.copy_(o.bonus)
        return o

    g_draft, lp = capture(lambda: ctx.propose(bonus, sstate.length), undo)
    g_verify, out = capture(verify, undo)
    out_ids = [first]
    for k in range(steps):
        g_draft()
        tree = build_ddtree(int(bonus), lp, budget)
        rec = ref.steps[k]
        assert torch.equal(tree.tokens.cpu(), rec.tree.tokens.cpu()) and torch.equal(tree.parents.cpu(), rec.tree.parents.cpu()), k
        for dst, src in zip(ins, (tree.tokens, tree.parents, tree.depths)):
            dst.copy_(src)
        g_verify()
        n = int(out.n_accepted)
        assert out.path[:n].tolist() == rec.accepted and int(out.bonus) == rec.bonus, k
        out_ids += tree.tokens[out.path[1:n].cpu()].tolist() + [int(out.bonus)]
    assert out_ids == ref.output_ids[: len(out_ids)]


@pytest.mark.parametrize("pairs_per_chunk,slice_", [(None, None), (2, None), (None, 8)],
                         ids=["one-product", "chunked", "cut"])
def test_the_capture_state_sketch_replayed_as_a_cuda_graph_equals_the_eager_sketch(monkeypatch, pairs_per_chunk,
                                                                                    slice_):
    """refcheck/sglang/capture/graphs.py over the committed-state sketch (refcheck/sglang/capture/state.py) of
    stand-in pools on the GPU: every replay, for two batch shapes and changing inputs, is bitwise the eager
    computation (the recurrent sketch in one product, in chunks of 2 (layer, request) pairs, or the conv and
    recurrent products cut into 8-feature slices, refcheck/sglang/capture/long_product.py); one graph per key; a
    computation that cannot be captured (it reads the device from the host) runs eagerly with its failure reported
    once."""
    from refcheck.sglang import vocab_rows
    from refcheck.sglang.capture import long_product
    from refcheck.sglang.capture.graphs import GraphCache
    from refcheck.sglang.capture.state import MambaPools, batch_state

    if pairs_per_chunk is not None:
        monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * 2 * 5 * 4 * pairs_per_chunk)  # float32 [pairs, HV*V*K]
    if slice_ is not None:
        monkeypatch.setattr(long_product, "SLICE", slice_)  # rec: 40 features, 5 slices; conv: 36, 4 and a rest

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = {3: (torch.randn(256, 2, 8, device=dev, generator=gen, dtype=torch.bfloat16),
              torch.randn(256, 2, 8, device=dev, generator=gen, dtype=torch.bfloat16))}
    mamba = MambaPools([0, 1], [0, 1], torch.randn(2, 9, 12, 3, device=dev, generator=gen, dtype=torch.bfloat16),
                       torch.randn(2, 9, 2, 5, 4, device=dev, generator=gen, dtype=torch.float32))
    table = torch.randperm(4 * 64, device=dev).reshape(4, 64).int()  # req_to_token: 4 requests' token slots
    to_mamba = torch.tensor([3, 1, 7, 5], device=dev)

    def sketch(rows, lens):
        slots = table[rows[:, None], lens[:, None] + torch.arange(4, device=dev)]  # [b, 4]
        return batch_state(kv, slots, mamba, to_mamba[rows])

    def flat(state):
        return torch.cat([e[2].reshape(-1) for e in state["kv"].values()]
                         + [state["mamba"]["conv"].reshape(-1), state["mamba"]["rec"].reshape(-1)])

    errors = []
    cache = GraphCache(lambda key, exc: errors.append((key, exc)))
    for step in range(6):
        b = 2 if step % 2 else 3
        rows, lens = torch.randperm(4, device=dev)[:b], torch.randint(0, 60, (b,), device=dev)
        got = flat(cache.run(("state", b), sketch, rows, lens))
        assert torch.equal(got, flat(sketch(rows, lens))), step
    assert len(cache) == 2 and not errors
    syncing = lambda rows, lens: rows * int(lens.sum())  # noqa: E731 - a host read: not capturable
    rows, lens = torch.arange(2, device=dev), torch.ones(2, device=dev, dtype=torch.long)
    assert torch.equal(cache.run("sync", syncing, rows, lens), rows * 2)
    assert torch.equal(cache.run("sync", syncing, rows, lens * 3), rows * 6)  # eager from then on
    assert len(errors) == 1 and errors[0][0] == "sync"
    assert cache.take_counts() == (6, 2)  # six replays (a capture's first call among them), two eager calls
    # the failed capture leaves the process's random ops working (SGLang samples with the default generator)
    assert torch.randperm(8, device=dev).sort().values.tolist() == list(range(8))
    assert 0 <= float(torch.rand(4, device=dev).min()) and torch.multinomial(torch.ones(3, device=dev), 2).numel() == 2


def test_the_vocab_reductions_in_row_chunks_replayed_as_a_cuda_graph_equals_the_whole_eager_call(monkeypatch):
    """The node summary and the drafter's top ranks in row chunks (refcheck/sglang/vocab_rows.py, 5 and 4 chunks
    here), replayed from CUDA graphs over changing inputs, are bitwise the unchunked reductions run eagerly."""
    from refcheck.sglang import vocab_rows
    from refcheck.sglang.capture.graphs import GraphCache
    from refcheck.sglang.capture.steps import _summary, node_logprobs, summarise_nodes
    from refcheck.sglang.draft_side import _top_rows, draft_top

    dev, rows, vocab = "cuda", 37, 3000
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = GraphCache(lambda key, exc: pytest.fail(f"{key} could not be captured: {exc}"))
    for step in range(4):
        logits = torch.randn(rows, vocab, device=dev, generator=gen) * 3
        picks = torch.randint(0, vocab, (rows,), device=dev, generator=gen)
        scores = logits[:35].to(torch.bfloat16).view(5, 7, vocab)  # [bs*(B-1), V] -> [bs, B-1, V]
        whole = _summary(logits, picks, 5, node_logprobs(logits)).tensors()
        whole_top = _top_rows(scores.view(35, vocab), 8)
        monkeypatch.setattr(vocab_rows, "CHUNK_BYTES", 4 * vocab * 8)  # 8 rows a chunk
        got = cache.run("nodes", lambda lg, pk: summarise_nodes(lg, pk).tensors(), logits, picks)
        top = cache.run("draft", lambda s: draft_top(s, 8), scores)
        monkeypatch.undo()
        for name, t in whole.items():
            assert torch.equal(got[name], t), (step, name)
        for name, t in whole_top.items():
            assert torch.equal(top[name].reshape(t.shape), t), (step, name)
    assert len(cache) == 2


def test_the_capture_hooks_record_the_same_from_their_cuda_graphs_as_eagerly(tmp_path, monkeypatch):
    """refcheck/sglang/capture/hooks.py with its device work replayed from CUDA graphs (the state sketch bucketed
    to 4 rows for 3 requests, the chain verify's reductions, the DFLASH taps; each cache's graphs in one memory
    pool) records what the same batches record eagerly (REFCHECK_CAPTURE_GRAPHS=off): tokens, top-k, the
    drafter's ranks and context, every state sketch."""
    on = dflash_batches(tmp_path / "on", monkeypatch, graphs=True)
    monkeypatch.undo()
    off = dflash_batches(tmp_path / "off", monkeypatch, graphs=False)
    assert_same_records(on, off)


def _syncs_from(package: str, fn: Callable[[], Any]) -> list[str]:
    """The stacks of the synchronising CUDA operations ``fn`` runs on the main thread (torch's sync debug mode)
    whose innermost caller outside torch is a file of ``package``."""
    found: list[str] = []

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message) or threading.current_thread() is not threading.main_thread():
            return
        frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and "warnings" not in f.filename]
        frames = [f for f in frames if f.filename != __file__ or f.name != "note"]
        if frames and f"/{package}/" in frames[-1].filename:
            found.append("".join(traceback.format_list(frames[-6:])))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return found


def test_the_capture_hooks_add_no_host_synchronisation_to_the_engine_step(tmp_path, monkeypatch):
    """refcheck/sglang/capture/hooks.py recording DFLASH decode batches from its CUDA graphs (captured by a first
    run: a capture synchronises) runs no synchronising CUDA operation on the scheduler's thread: the engine's
    next step is never made to wait for the device by its capture (the writer thread waits, not the engine)."""
    from refcheck.sketch import sketch_rows

    x = torch.ones(2, 8, device="cuda")
    sketch_rows(x)  # its projection made
    assert len(_syncs_from("refcheck", lambda: sketch_rows(x))) == 1  # the detector sees refcheck's own copy to host
    dflash_batches(tmp_path / "warm", monkeypatch, graphs=True)
    monkeypatch.undo()
    syncs = _syncs_from("refcheck", lambda: dflash_batches(tmp_path / "run", monkeypatch, graphs=True))
    assert not syncs, "\n".join(syncs)


def test_the_capture_hooks_add_no_host_synchronisation_to_a_prefill_a_tree_verify_or_a_target_only_step(tmp_path,
                                                                                                      monkeypatch):
    """The same for tests/capture_kit.py: tree_and_root_batches on the GPU (NGRAM's and REFCHECK_DDTREE's tree
    verify, NONE's target-only step, every algorithm's prefill), after a first run has captured the graphs; its
    records are the CPU run's."""
    cpu, *_ = tree_and_root_batches(tmp_path / "cpu", monkeypatch, "cpu")
    monkeypatch.undo()
    tree_and_root_batches(tmp_path / "warm", monkeypatch, "cuda")
    monkeypatch.undo()
    got: list = []
    syncs = _syncs_from("refcheck", lambda: got.extend(tree_and_root_batches(tmp_path / "run", monkeypatch, "cuda")))
    assert not syncs, "\n".join(syncs)
    cap = got[0]
    assert not cap.errors, cap.errors
    assert [p.token for p in cap.prefills[0]] == [p.token for p in cpu.prefills[0]]
    assert [(s.rid, s.accepted, s.emitted, s.topk_ids) for s in cap.steps[0]] == \
           [(s.rid, s.accepted, s.emitted, s.topk_ids) for s in cpu.steps[0]]


def test_a_host_copy_still_in_flight_is_read_after_it_lands():
    """SGLang's overlap scheduler copies a batch's tokens into pinned host memory on its copy stream and returns
    before the copy lands (``copy_done`` marks its end): ``on_device`` with that event reads the tokens in stream
    order, never the host buffer's earlier contents. Without the event the same read takes the stale values (the
    trials show the hazard is real on this device)."""
    from refcheck.sglang.capture.batch import on_device

    copy = torch.cuda.Stream()
    stale_unguarded = 0
    for k in range(40):
        src = torch.full((4096,), k + 1, device="cuda", dtype=torch.int64)
        for guarded in (True, False):
            host = torch.zeros(4096, dtype=torch.int64).pin_memory()
            done = torch.cuda.Event()
            copy.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy):
                torch.cuda._sleep(2_000_000)  # the copy stream is busy: the copy lands a millisecond later
                host.copy_(src, non_blocking=True)
                done.record()
            got = on_device(host, "cuda", done if guarded else None)
            if guarded:
                assert torch.equal(got, src), (k, got[:4])
            else:
                stale_unguarded += int(not torch.equal(got, src))
            torch.cuda.synchronize()
    assert stale_unguarded > 0, "the unguarded read never saw stale values: the test does not show the hazard"
