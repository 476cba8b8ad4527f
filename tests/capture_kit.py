"""Stand-ins for SGLang's scheduler, batches, pools and DFLASH worker as the capture hooks see them, and a graph
cache that replays like CUDA graphs on any device.

Contract: the stand-ins carry exactly the attributes the hooks read (SGLang 0.5.17's names, docs/sglang-capture.md):
:func:`make_scheduler` (stand-in KV, mamba and req_to_token pools), :func:`make_batch`, :func:`run_prefill` and
:func:`make_tree` (two requests' draft trees), each on the CPU or a given device; :func:`tree_and_root_batches`
runs a prefill, a tree verify step and a target-only step through the hooks on a device;
:func:`fresh_hooks` puts the hooks in a new process's state, recording
into a directory, and :func:`read_capture` reads it once the writer has written every queued record.
:func:`dflash_batches` runs four DFLASH decode batches through the hooks and returns the recorded chain steps,
:func:`target_only_batches` three target-only decode batches;
:func:`assert_same_records` holds two such runs equal (tokens, top-k, drafter ranks and context, state sketches).
:class:`ReplayingCache` is a :class:`~refcheck.sglang.capture.graphs.GraphCache` with a CUDA graph's semantics
wherever the tensors live: a key's first call fixes its computation (the closure of that call) and its static
inputs and outputs; every call copies its inputs into the static inputs, reruns the fixed computation and writes
the result into the same output tensors; and it scribbles over the outputs of every other key of the cache (they
share one memory pool). A caller that hands a graph per-call values through its closure, or keeps a graph's
outputs past another replay of the cache, gets wrong records from it, as it would on the GPU.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import torch

from refcheck.sglang.capture import hooks, records, snapshot
from refcheck.sglang.capture.graphs import GraphCache
from refcheck.sglang.capture.packing import Packed


def read_capture(root):
    """The capture directory once the hooks' writer thread has written every queued record."""
    assert hooks.drain(10.0)
    return records.read_capture(root)


V, N, HKV, D, C, KM1, HV, DK, DV = 32, 4, 2, 3, 6, 3, 2, 4, 5


class Mode:
    def __init__(self, name: str) -> None:
        self.name = name

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_idle(self) -> bool:
        return False

    def is_target_verify(self) -> bool:
        return False


def make_scheduler(topk: int = 4, dev: str = "cpu"):
    """A scheduler whose pools live on ``dev`` (their values drawn on the CPU, the same on every device)."""
    gen = torch.Generator().manual_seed(0)
    kb, vb = torch.randn(64, HKV, D, generator=gen).to(dev), torch.randn(64, HKV, D, generator=gen).to(dev)
    kv_pool = NS(full_attention_layer_id_mapping={2: 0}, get_key_buffer=lambda layer: kb, get_value_buffer=lambda layer: vb)
    conv = [torch.randn(1, 5, C, KM1, generator=gen).to(dev)]  # [n_lin, slots, C, K-1]
    temporal = torch.randn(1, 5, HV, DV, DK, generator=gen).to(dev)  # [n_lin, slots, HV, V, K]
    req_to_token = torch.arange(3 * 20, dtype=torch.int32, device=dev).reshape(3, 20).flip(1)  # slots in reverse order
    rtp = NS(req_to_token=req_to_token, mamba_map={0: 0},
             req_index_to_mamba_index_mapping=torch.tensor([0, 4, 2], device=dev),
             mamba_pool=NS(mamba_cache=NS(conv=conv, temporal=temporal), conv_window_axis=-1))
    runner = NS(token_to_kv_pool=kv_pool, req_to_token_pool=rtp)
    return NS(tp_rank=0, server_args=NS(speculative_eagle_topk=topk), tp_worker=NS(model_runner=runner)), kb, conv, temporal


def make_batch(mode: str, spec: bool, outputs: list[list[int]], dev: str = "cpu"):
    # SGLang 0.5.17's requests: a prefill chunk's end in extend_range (the whole prompt, or prompt and output after a
    # retraction), no fill_ids
    reqs = [NS(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=list(o), extend_range=NS(start=0, end=3 + len(o)))
            for i, o in enumerate(outputs)]
    return NS(forward_mode=Mode(mode), reqs=reqs, spec_algorithm=NS(is_none=lambda: not spec),
              req_pool_indices=torch.tensor([1, 2][: len(reqs)], device=dev), is_extend_in_batch=False)


def run_prefill(sched, dev: str = "cpu", gen: torch.Generator | None = None) -> torch.Tensor:
    """A prefill of two requests through run_batch; returns its logits [2, V] (drawn on the CPU, from ``gen``)."""
    logits0 = torch.randn(2, V, generator=gen).to(dev)
    hooks._run_batch(lambda self, batch: NS(logits_output=NS(next_token_logits=logits0), next_token_ids=logits0.argmax(-1)),
                      sched, make_batch("extend", True, [[], []], dev))
    return logits0


def make_tree() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two requests' trees (tokens [bs*N], first-child and next-sibling links [bs, N]): 0 -> {1, 2}, 1 -> 3."""
    return (torch.tensor([7, 11, 12, 13, 9, 21, 22, 23]), torch.tensor([[1, 3, -1, -1]] * 2),
            torch.tensor([[-1, 2, -1, -1]] * 2))


def tree_and_root_batches(tmp_path, monkeypatch, dev: str = "cpu"):
    """A prefill of two requests, a tree verify step (SGLang's ``eagle_sample``: 0 -> {1, 2}, 1 -> 3; request 0
    accepts [0, 2], request 1 [0, 1, 3]) and a target-only decode step through the hooks, with stand-ins on
    ``dev``: (the capture read back, the prefill's, the verify's and the target-only step's logits). Every value is
    drawn on the CPU from one seeded generator, so runs on any devices see the same batches."""
    fresh_hooks(monkeypatch, tmp_path)
    gen = torch.Generator().manual_seed(1)
    sched, *_ = make_scheduler(dev=dev)
    logits0 = run_prefill(sched, dev, gen)
    tokens, nt, ns = (t.to(dev) for t in make_tree())
    logits = torch.randn(2 * N, V, generator=gen).to(dev)
    verify_input = NS(draft_token=tokens, retrieve_next_token=nt, retrieve_next_sibling=ns,
                      positions=torch.tensor([3, 4, 4, 5, 3, 4, 4, 5], device=dev))
    accept_index = torch.tensor([[0, 2, -1, -1], [4, 5, 7, -1]], device=dev)
    accept_lens, predict = torch.tensor([2, 3], device=dev), torch.tensor([12, 0, 30, 0, 21, 23, 0, 31], device=dev)

    def verify(self, b):
        hooks._eagle_sample(lambda vi, bb, lo, grammar_mask=None: (predict, accept_lens, accept_index), verify_input, b,
                            NS(next_token_logits=logits.clone()))
        return NS(logits_output=None, next_token_ids=None)

    hooks._run_batch(verify, sched, make_batch("decode", True, [[7], [9]], dev))
    root_logits = torch.randn(2, V, generator=gen).to(dev)
    hooks._run_batch(lambda self, b: NS(logits_output=NS(next_token_logits=root_logits), next_token_ids=root_logits.argmax(-1)),
                     sched, make_batch("decode", False, [[7, 12, 30], [9, 21, 23, 31]], dev))
    return read_capture(tmp_path), logits0, logits, root_logits


def target_only_batches(tmp_path, monkeypatch, graphs: bool, dev: str = "cpu") -> list:
    """Three target-only decode batches (NONE's step: 2, 2 and 1 requests, the second the first's shape again) through
    the capture hooks with stand-ins on ``dev``, the hooks' device work through their graph caches or eager
    (``graphs``): the steps read back, in order. Every input comes from one seeded generator."""
    fresh_hooks(monkeypatch, tmp_path)
    monkeypatch.setenv("REFCHECK_CAPTURE_GRAPHS", "on" if graphs else "off")
    gen = torch.Generator().manual_seed(3)
    sched, *_ = make_scheduler(dev=dev)
    for outputs in ([[7], [9]], [[7, 12], [9, 21]], [[7, 12, 30]]):
        logits = torch.randn(len(outputs), V, generator=gen).to(dev)
        hooks._run_batch(lambda self, b, lg=logits: NS(logits_output=NS(next_token_logits=lg), next_token_ids=lg.argmax(-1)),
                         sched, make_batch("decode", False, outputs, dev))
    cap = read_capture(tmp_path)
    assert not cap.errors, cap.errors
    return cap.steps[0]


def fresh_hooks(monkeypatch, root):
    """The capture hooks as a new scheduler process has them, recording into ``root``: returns ``root``."""
    monkeypatch.setenv("REFCHECK_CAPTURE_DIR", str(root))
    for name, value in (("_recorder", None), ("_unrecordable", None), ("_rule", None), ("_bad_rule", None),
                        ("_clock", None)):
        monkeypatch.setattr(hooks, name, value)
    monkeypatch.setattr(snapshot, "_mixed_said", False)
    return root


def _into(dst: Any, src: Any) -> None:
    """Copy a nest of tensors into a nest of the same shape, in place."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, Packed):  # a graph's packed output: its one buffer
        dst.data.copy_(src.data)
    elif isinstance(dst, dict):
        for k in dst:
            _into(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _into(a, b)


def _scribble(nest: Any) -> None:
    """Overwrite every tensor of a nest (NaN, or -1 where NaN does not fit)."""
    if isinstance(nest, torch.Tensor):
        nest.fill_(float("nan") if nest.is_floating_point() else -1)
    elif isinstance(nest, Packed):  # its bytes, all ones: NaN in every float, -1 in every integer
        nest.data.fill_(255)
    elif isinstance(nest, dict):
        for v in nest.values():
            _scribble(v)
    elif isinstance(nest, (list, tuple)):
        for v in nest:
            _scribble(v)


class ReplayingCache(GraphCache):
    """A CUDA graph cache's semantics on any device (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.replays: dict[Any, tuple[Any, tuple[torch.Tensor, ...], Any]] = {}

    def __len__(self) -> int:
        return len(self.replays)

    def run(self, key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        self.replayed += 1  # counted as GraphCache counts a replay
        if key not in self.replays:
            static = tuple(t.clone() for t in inputs)
            self.replays[key] = (fn, static, fn(*static))
        captured, static, outputs = self.replays[key]
        for other, (_, _, out) in self.replays.items():
            if other != key:
                _scribble(out)
        for s, t in zip(static, inputs):
            s.copy_(t)
        _into(outputs, captured(*static))
        return outputs


def assert_same_records(on: list, off: list) -> None:
    """Two runs of :func:`dflash_batches` recorded the same steps."""
    assert len(on) == len(off) == 10
    for a, b in zip(on, off):
        assert (a.rid, a.tokens, a.topk_ids, a.argmax, a.emitted, a.draft_ids) == \
               (b.rid, b.tokens, b.topk_ids, b.argmax, b.emitted, b.draft_ids)
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-6)
        assert torch.allclose(torch.tensor(a.draft_logprobs), torch.tensor(b.draft_logprobs), atol=1e-6)
        assert torch.allclose(a.context_sketch, b.context_sketch, atol=1e-5)
        assert set(a.state) == set(b.state) and a.state
        for name in a.state:
            assert torch.allclose(a.state[name][2].float(), b.state[name][2].float(), atol=1e-5, rtol=1e-4), name


def dflash_batches(tmp_path, monkeypatch, graphs: bool, dev: str = "cuda", rid: Any = None) -> list:
    """Four DFLASH decode batches (3, 2, 3 and 2 requests) through the capture hooks with stand-ins for SGLang's
    scheduler, pools and DFLASH worker on ``dev``, the hooks' device work
    through their graph caches or run eagerly (``graphs``): the chain steps read back, in order. Every input comes
    from one seeded generator, so two calls see the same batches. ``rid(i)``: request i's rid (default ``r{i}``)."""
    from refcheck.sglang.capture.state import MambaPools  # noqa: F401 - the pools' layout the stand-ins follow

    fresh_hooks(monkeypatch, tmp_path)
    monkeypatch.setenv("REFCHECK_CAPTURE_GRAPHS", "on" if graphs else "off")
    V, B, H, F = 64, 4, 8, 12
    gen = torch.Generator(device=dev).manual_seed(0)
    kb, vb = (torch.randn(256, 2, 3, device=dev, generator=gen) for _ in range(2))
    conv, ssm = torch.randn(1, 9, 6, 3, device=dev, generator=gen), torch.randn(1, 9, 2, 5, 4, device=dev, generator=gen)
    rtp = NS(req_to_token=torch.randperm(256, device=dev, generator=gen).reshape(4, 64).int(), mamba_map={0: 0},
             req_index_to_mamba_index_mapping=torch.tensor([1, 4, 2, 7], device=dev),
             mamba_pool=NS(mamba_cache=NS(conv=[conv], temporal=ssm), conv_window_axis=-1))
    kv_pool = NS(full_attention_layer_id_mapping={2: 0}, get_key_buffer=lambda layer: kb, get_value_buffer=lambda layer: vb)
    sched = NS(tp_rank=0, server_args=NS(speculative_eagle_topk=1),
               tp_worker=NS(model_runner=NS(token_to_kv_pool=kv_pool, req_to_token_pool=rtp)))
    head = torch.randn(V, H, device=dev, generator=gen)
    for k, bs in enumerate((3, 2, 3, 2)):
        hidden, feats = torch.randn(bs * B, H, device=dev, generator=gen), torch.randn(bs * B, F, device=dev, generator=gen)
        logits = torch.randn(bs * B, V, device=dev, generator=gen)
        w = NS(block_size=B, _draft_block_tokens_buf=torch.randint(0, V, (8, B), device=dev, generator=gen),
               draft_model_runner=NS(forward=lambda fb, h=hidden: NS(logits_output=NS(hidden_states=h.clone()),
                                                                  can_run_graph=True),
                                     model=NS(num_context_features=2)),
               target_worker=NS(model_runner=NS(model=NS(lm_head=NS(weight=head)), model_config=NS(vocab_size=V))),
               _append_target_hidden_to_draft_kv_by_loc=lambda **kw: None)
        res = NS(logits_output=NS(next_token_logits=logits), accept_lens=torch.full((bs,), 2, dtype=torch.int32, device=dev),
                 next_token_ids=logits.argmax(-1), can_run_cuda_graph=True)

        def step(self_, bb, res=res, feats=feats, bs=bs, k=k):
            self_.draft_model_runner.forward(None)
            self_._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=feats, cache_loc=torch.arange(bs * B, device=dev),
                positions=torch.arange(bs * B, device=dev) + 10 * k, commit_lens=torch.full((bs,), 2, device=dev))
            return res

        reqs = [NS(rid=rid(i) if rid else f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[5] * (k + 1),
                   extend_range=None) for i in range(bs)]
        batch = NS(forward_mode=NS(is_extend=lambda: False, is_decode=lambda: True, is_idle=lambda: False),
                   reqs=reqs, spec_algorithm=NS(is_none=lambda: False), is_extend_in_batch=False,
                   req_pool_indices=torch.tensor([2, 0, 3][:bs], device=dev))
        hooks._run_batch(lambda self, b, w=w, step=step: hooks._dflash_forward(step, w, b), sched, batch)
    assert hooks.drain(30.0)
    cap = records.read_capture(tmp_path)
    assert not cap.errors, cap.errors
    return cap.steps[0]
