"""The SGLang worker of ``REFCHECK_DDTREE`` (imports SGLang; loaded in the scheduler process).

Contract: :class:`DDTreeWorker` is SGLang's NGRAM worker with the n-gram corpus replaced by DFlash +
DDTree. Per decode step and request: the DFlash drafter (one context per request) proposes per-depth
log-probs for the block after the last emitted token; refcheck's Algorithm 1 builds the tree of
``speculative_num_draft_tokens - 1`` nodes below it; NGRAM's own preparation turns drafts + ancestor
masks into SGLang's tree verify input; the target verifies the tree in one forward (the hybrid GDN
backend on its per-node path, since the algorithm runs with ``speculative_eagle_topk > 1``), and
then SGLang's ``eagle_sample`` walks it greedily, ``commit_mamba_states_after_verify`` commits the
last accepted node's conv/recurrent state, and ``move_accept_tokens_to_target_kvcache`` compacts the
accepted nodes' KV. The drafter's context is extended with the target's captured hidden states of
the root and the accepted nodes, in path order (prefill: every prompt position).

CUDA graphs: the target's verify replays SGLang's captured ``TARGET_VERIFY`` graph (NGRAM's path:
the graph is captured for ``speculative_num_draft_tokens`` = budget + 1 tokens per request, and
every tree here has exactly that many nodes, so no request is padded; SGLang pads the batch to its
captured batch size). The graph returns the hidden states only because the algorithm's server-args
check raised the server's hidden-state ceiling to ``full`` before capture; the worker refuses to
start without it. The drafter and the tree builder stay eager (pure PyTorch, once per request), and
every tensor the worker keeps from a verify (the drafter's context rows) is copied out of the
graph's output buffers within the step.

``fault`` (a key of :mod:`refcheck.sglang.ddtree.faults`, set by the ``REFCHECK_DDTREE_FAULT_*``
algorithms; None = correct) feeds one of SGLang's steps a wrong index (the verify positions, the
bonus, the mamba commit's or the KV move's accept index) or the drafter a wrong context or tree.

``shadow`` (``REFCHECK_DDTREE_SHADOW``): the drafter's DDTree of :data:`SHADOW_BUDGET_ENV` nodes is built
and recorded, but the chain of the top-1 draft token per depth (the whole block) is what SGLang verifies:
how DDTree is brought up on a hybrid target before its per-node state is trusted.

The drafter's side of each step, for refcheck's capture (only when ``REFCHECK_CAPTURE_DIR`` is set):
:attr:`DDTreeWorker.last_sides` maps a request of the last decode step to its draft top-k per depth, the
positions and feature sketch of the context fed to the drafter from the verify, and the shadow tree
(:mod:`refcheck.sglang.draft_side`).

Every SGLang call goes through its module attribute (``eagle_utils.eagle_sample`` ...), so
refcheck's capture hooks see this worker exactly as they see NGRAM's. Refusals (ValueError at
start-up, SGLang reports them): tensor parallelism > 1, a draft checkpoint that is not DFlash, a
budget deeper than the draft block allows to fill.

Temperature > 0: a batch with sampled requests is verified by refcheck's keyed sampler
(:mod:`refcheck.sglang.ddtree.sampling`, the reference decoder's rule with its Philox keys) instead
of ``eagle_sample``; their trees are built from the drafter's log-probs at the request's
temperature, and their first token after the prefill is the keyed draw too, so a sampled run replays
exactly. :attr:`DDTreeWorker.last_first_uniforms` keeps the last prefill's uniforms for the capture.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative import eagle_utils
from sglang.srt.speculative import ngram_worker as ngram
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from ddtree_reference.drafter import DFlashDrafter
from refcheck.sglang.ddtree import faults, sampling
from refcheck.sglang.ddtree.drafts import DrafterPool, TargetView, draft_tree, extend_context
from refcheck.sglang.ddtree.hidden_states import HIDDEN_STATES_CEILING, hidden_states_ceiling_is_full
from refcheck.sglang.ddtree.layout import batch_layout
from refcheck.sglang.ddtree.sampling import RequestKeys
from refcheck.sglang.ddtree.shadow import SHADOW_BUDGET_ENV
from refcheck.sglang.draft_side import context_side, draft_side, topk_for
from refcheck.sglang.env import ENV_DIR

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _raw_logits(runner: Any, sampled: bool) -> Iterator[list[torch.Tensor]]:
    """While a sampling batch's target forward runs, keep its logits from just before SGLang's sampler
    overwrites them in place with ``softmax(logits / T)`` (``ModelRunner.sample``, an instance-level wrap
    removed afterwards)."""
    raw: list[torch.Tensor] = []
    sample = getattr(runner, "sample", None)
    if not sampled or sample is None:
        yield raw
        return

    def keep(logits_output, *args, **kwargs):
        raw.append(logits_output.next_token_logits.clone())
        return sample(logits_output, *args, **kwargs)

    own = "sample" in vars(runner)  # an instance attribute to put back, else the class's method (or its hook)
    runner.sample = keep
    try:
        yield raw
    finally:
        if own:
            runner.sample = sample
        else:
            del runner.sample


class _Contexts:
    """Stands where NGRAM keeps its corpus: the scheduler-facing calls map to drafter contexts."""

    def __init__(self, pool: DrafterPool) -> None:
        self.pool = pool

    def erase_match_state(self, rids) -> None:
        self.pool.drop(rids)

    def synchronize(self) -> None:
        pass

    def reset(self) -> None:
        self.pool.clear()


class DDTreeWorker(ngram.NGRAMWorker):
    #: an injected engine fault (refcheck/sglang/ddtree/faults.py), or None for the correct worker
    fault: str | None = None
    #: shadow mode: build the DDTree, verify the chain (module docstring)
    shadow: bool = False

    # SGLang passes keywords: 0.5.17 gives ``ps`` (its parallel state), 0.5.23 does not
    def __init__(self, server_args, gpu_id, nccl_port, target_worker, ps=None, **_ignored) -> None:
        BaseSpecWorker.__init__(self)  # not NGRAM's: no n-gram corpus to build
        self.server_args = server_args
        self.enable_overlap = not server_args.disable_overlap_schedule
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.tp_rank = ps.tp_rank if ps is not None else 0  # TP 1 is enforced below
        self.page_size = server_args.page_size
        self.draft_token_num = self.speculative_num_draft_tokens = int(server_args.speculative_num_draft_tokens)
        self.topk = server_args.speculative_eagle_topk
        self.speculative_num_steps = server_args.speculative_num_steps
        self.max_trie_depth = 0
        self.device = server_args.device
        self.adaptive_controller = None
        self._prev_decode_rids: set = set()
        self.grammar_tree_host = None
        if int(getattr(server_args, "tp_size", 1) or 1) > 1:
            raise ValueError("REFCHECK_DDTREE runs with tensor parallelism 1 (its drafter needs the whole head)")
        target_args = getattr(self.model_runner, "server_args", server_args)  # what the graph runner reads
        if not hidden_states_ceiling_is_full(target_args):
            raise ValueError(f"REFCHECK_DDTREE needs the server's hidden-state ceiling at {HIDDEN_STATES_CEILING!r} "
                             "(return_hidden_states_mode): the target's CUDA graphs would be captured without the hidden "
                             "states its drafter reads; the algorithm's server-args check sets it (did it run?)")
        self.budget = self.draft_token_num - 1
        self.shadow_budget = int(os.environ.get(SHADOW_BUDGET_ENV) or 15) if self.shadow else None
        self.capturing = bool(os.environ.get(ENV_DIR))
        #: rid -> the drafter's side of its last decode step (module docstring), when capturing
        self.last_sides: dict[str, dict] = {}
        model = self.model_runner.model
        cfg = self.model_runner.model_config
        view = TargetView.from_sglang(model, int(cfg.vocab_size), int(cfg.num_hidden_layers))
        self.drafter = DFlashDrafter.load(Path(server_args.speculative_draft_model_path), view)
        if not hasattr(model, "set_dflash_layers_to_capture"):
            raise ValueError(f"{type(model).__name__} cannot capture the hidden states DFlash drafts from")
        if self.shadow and self.budget != self.drafter.block_size - 1:
            raise ValueError(f"REFCHECK_DDTREE_SHADOW verifies the whole draft block as a chain: "
                             f"--speculative-num-draft-tokens must be the block size {self.drafter.block_size}")
        # the drafter-layers fault captures the hidden states after the layers one past the drafter's own
        shift = 1 if self.fault == "draft-wrong-layers" else 0
        model.set_dflash_layers_to_capture([i + shift for i in self.drafter.target_layer_ids])
        self.pool = DrafterPool(self.drafter)
        #: seconds this worker spent drafting and building trees in its last decode step (None after a
        #: prefill); refcheck's capture records it as the step's "draft" phase
        self.last_draft_s: float | None = None
        self.ngram_corpus = _Contexts(self.pool)
        #: the keyed sampler's parameters of the requests of the batch being drafted (None = greedy)
        self.keys: list[RequestKeys | None] = []
        #: rid -> the uniform of its first token's keyed draw, for the requests of the last prefill that sampled
        self.last_first_uniforms: dict[str, float] = {}
        logger.info("REFCHECK_DDTREE: budget %d, draft block %d, target layers %s", self.budget,
                    self.drafter.block_size, self.drafter.target_layer_ids)

    # -- drafting -------------------------------------------------------------------------------------
    def _prepare_draft_tokens(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """NGRAM's hook for its corpus lookup: here DFlash + DDTree, one tree per request."""
        t0 = time.perf_counter()
        trees = []
        self.keys = [sampling.request_keys(req.rid, req.sampling_params) for req in batch.reqs]
        self.last_sides = {}
        for req, keys in zip(batch.reqs, self.keys):
            start = len(req.origin_input_ids) + len(req.output_ids) - 1  # the root's position
            left = getattr(req.sampling_params, "max_new_tokens", None)
            depth = None if left is None or self.shadow else \
                max(1, min(self.drafter.block_size - 1, int(left) - len(req.output_ids)))
            temperature = keys.sampling.temperature if keys is not None else None
            root, shift = int(req.output_ids[-1]), self.fault == "draft-depth-shift"
            tokens, parents, logp = draft_tree(self.pool, req.rid, root, start, None if self.shadow else self.budget,
                                               depth, temperature, shift)
            trees.append((tokens, parents))
            if self.capturing and req.rid not in self.pool.partial:  # a partial context's drafts are not judged
                side = self.last_sides[req.rid] = draft_side(logp, topk_for(self.shadow_budget or self.budget,
                                                                            int(logp.shape[-1])), logits=False)
                if self.shadow:
                    side["shadow_tokens"], side["shadow_parents"] = self._shadow_tree(root, logp, temperature)
        self.last_draft_s = time.perf_counter() - t0  # the drafter's .cpu() hand-off has synchronised
        return batch_layout(trees, self.draft_token_num)

    def _shadow_tree(self, root: int, logp: torch.Tensor, temperature: float | None) -> tuple[list[int], list[int]]:
        """The DDTree of the shadow budget from the draft (at the request's temperature when sampled)."""
        from ddtree_reference.tree import build_ddtree

        lp = torch.log_softmax(logp / temperature, dim=-1) if temperature is not None else logp
        tree = build_ddtree(root, lp, int(self.shadow_budget or 15))
        return tree.tokens.tolist(), tree.parents.tolist()

    def _extend(self, rids: list[str], hidden: torch.Tensor, rows: list[torch.Tensor], starts: list[int],
                decode: bool = False) -> None:
        """Grow each request's drafter context by ``hidden[rows]`` at consecutive positions from its start (the
        drafter faults alter what is fed); a decode step's feed is recorded for the capture."""
        for rid, r, start in zip(rids, rows, starts):
            if decode and self.fault == "draft-skip-last" and len(r) > 1:
                r = r[:-1]  # the last accepted node's features are left out
            if self.fault == "draft-positions-shifted":
                start += 1
            feed = hidden[r.to(hidden.device)]  # [A, n_ids*H]
            extend_context(self.pool, rid, feed, start)
            if decode and self.capturing and rid not in self.pool.partial:
                side = self.last_sides.setdefault(rid, {})
                side.update(context_side(feed, torch.arange(start, start + len(r))))

    # -- one scheduler step ---------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        ngram.record_stream_for_v2_verify(batch, None, torch.get_device_module(self.device).current_stream())
        rids = [r.rid for r in batch.reqs]
        self.last_draft_s = None
        decode = batch.forward_mode.is_decode()
        out, next_token_ids, accept_lens, accept_tokens, new_seq_lens = \
            self._verify(batch, rids) if decode else self._prefill(batch, rids)
        out.logits_output.hidden_states = None  # no hidden-state copies to the host
        if on_publish is not None:
            on_publish(new_seq_lens)
        if decode:  # requests that left the decode batch free their contexts
            self.pool.drop(self._prev_decode_rids - set(rids))
            self._prev_decode_rids = set(rids)
        return ngram.GenerationBatchResult(
            logits_output=out.logits_output, next_token_ids=next_token_ids, can_run_cuda_graph=out.can_run_cuda_graph,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=self.draft_token_num, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=self.speculative_num_draft_tokens)

    def _verify(self, batch, rids: list[str]) -> tuple:
        """A decode step: draft the trees, verify them in one target forward, walk, commit state and KV."""
        bs, n = len(batch.reqs), self.draft_token_num
        prefix = batch.seq_lens.cpu().tolist()
        self._prepare_for_speculative_decoding(batch)
        verify_input: NgramVerifyInput = batch.spec_info
        verify_input.capture_hidden_mode = CaptureHiddenMode.FULL
        if self.fault == "flat-positions":  # in place: SGLang's preallocated buffer is what the forward reads
            verify_input.positions.copy_(faults.flat_positions(verify_input.positions, bs, n))
        out = self.target_worker.forward_batch_generation(batch, is_verify=True, capture_hidden_mode=CaptureHiddenMode.FULL)
        logits_output = out.logits_output
        if any(k is not None for k in self.keys):  # refcheck's keyed sampler (module docstring), seen by the capture
            predict, accept_lens, accept_index, _, _ = sampling.keyed_sample(verify_input, batch, logits_output,
                                                                             faults.sampler_keys(self.keys, self.fault))
        else:
            predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, logits_output, None)
        new_seq_lens = batch.seq_lens + accept_lens
        if self.fault == "bonus-neighbour":
            predict = faults.neighbour_bonus(predict, accept_index, accept_lens, logits_output.next_token_logits, n)
        commit_index = faults.chain_accept_index(accept_index, accept_lens, n) \
            if self.fault == "mamba-flat-index" else accept_index
        ngram.commit_mamba_states_after_verify(self.target_worker, batch, accept_lens, commit_index, n)
        next_token_ids = predict[accept_index].flatten()
        move_index = faults.skip_last_move(accept_index, accept_lens, n) if self.fault == "kv-move-last" else accept_index
        ngram.move_accept_tokens_to_target_kvcache(batch, move_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        idx, lens = accept_index.cpu(), accept_lens.cpu().tolist()
        # the drafter's context grows by the root and the accepted drafts (flat node rows), in path order
        self._extend(rids, logits_output.hidden_states, [idx[b, : lens[b]].long() for b in range(bs)], prefix, decode=True)
        batch.forward_mode = ForwardMode.DECODE
        return out, next_token_ids, accept_lens, next_token_ids, new_seq_lens

    def _prefill(self, batch, rids: list[str]) -> tuple:
        """A prefill (chunk): the target forward, fresh drafter contexts, and each sampled request's keyed first token."""
        bs = len(batch.reqs)
        keys = [sampling.request_keys(r.rid, r.sampling_params) for r in batch.reqs]
        with _raw_logits(self.model_runner, any(k is not None for k in keys)) as raw:
            out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        logits = raw[0] if raw else out.logits_output.next_token_logits  # [bs, V]
        next_token_ids = self._keyed_first_tokens(batch, faults.sampler_keys(keys, self.fault), logits, out.next_token_ids)
        hidden = out.logits_output.hidden_states  # [extend tokens, n_ids*H]
        offsets = np.cumsum([0] + list(batch.extend_lens))
        for b, rid in enumerate(rids):
            self.pool.admit(rid, int(batch.prefix_lens[b]))  # a new request: a fresh context
        self._extend(rids, hidden, [torch.arange(int(offsets[b]), int(offsets[b + 1])) for b in range(bs)],
                     [int(p) for p in batch.prefix_lens])
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        accept_tokens = torch.zeros(bs, self.draft_token_num, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = next_token_ids
        return out, next_token_ids, accept_lens, accept_tokens.flatten(), batch.seq_lens.clone()

    def _keyed_first_tokens(self, batch, keys: list[RequestKeys | None], logits: torch.Tensor,
                            next_token_ids: torch.Tensor) -> torch.Tensor:
        """SGLang's sampled first tokens replaced by the keyed draws, for the sampled requests whose prompt
        this chunk completes (``logits`` ``[bs, V]``: each request's last position)."""
        self.last_first_uniforms = {}
        out = next_token_ids
        for b, (req, key) in enumerate(zip(batch.reqs, keys)):
            prompt_len = len(req.origin_input_ids)
            if key is None or int(batch.prefix_lens[b]) + int(batch.extend_lens[b]) < prompt_len:
                continue
            token, u = sampling.first_token(logits[b], key, prompt_len)
            if out is next_token_ids:
                out = next_token_ids.clone()  # SGLang's own tensor stays as it drew it
            out[b] = token
            self.last_first_uniforms[req.rid] = u
        return out
