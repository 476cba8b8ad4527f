"""A fake SGLang built from the reference, for the capture's CPU tests (tests/test_sglang_capture.py,
tests/test_sglang_served.py).

The fake engine holds exactly what SGLang holds at a verify step (flat node tokens, first-child / next-sibling links,
flat logits, ``accept_index`` / ``accept_lens`` / ``predict`` or DFLASH's candidates / commit lengths / ``out_tokens``,
and KV / conv / SSM pools in SGLang's layouts behind ``req_to_token`` and mamba-slot indirection, batched over several
requests, sharded as tensor-parallel ranks hold them), computed with the reference's own target. :func:`fake_sglang`
runs it and returns its capture; :func:`fake_engine_setup` what it runs; :func:`_sampled` the capture a sampled run
makes of the same steps; ``_prov`` and ``_replay`` the provenance and the replay the tests judge with.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from ddtree_reference.sampling import Sampling, request_key
from ddtree_reference.tree import Tree
from refcheck.diff.judge import judge
from refcheck.pool import ReferencePool
from refcheck.prompts import load_prompts
from refcheck.reference_runner import EngineSpec, ReferenceRunner
from refcheck.sglang.capture.assemble import sibling_ranks
from refcheck.sglang.capture.records import Capture
from refcheck.sglang.capture.state import MambaPools, batch_state, request_state
from refcheck.sglang.capture.steps import StepCapture, chain_steps, prefill_records, summarise_nodes, tree_steps
from refcheck.sglang.ddtree.sampling import RequestKeys, first_token, sample_tree
from refcheck.sglang.layout import links_from_parents

# --dist loadgroup: one xdist worker runs the whole module, so
# its module fixture (the reference run the captures are cut from) is computed once.

SLOTS, MAMBA_SLOTS, MAX_LEN = 512, 9, 128


def _pools(target, states, seed=0):
    """SGLang-layout pools holding each request's committed state, behind permuted slots."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(SLOTS, generator=gen)
    req_to_token = torch.zeros(len(states) + 1, MAX_LEN, dtype=torch.int32)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mslots = [3 + 2 * b for b in range(len(states))]
    for b, st in enumerate(states):
        req_to_token[b + 1, : st.length] = perm[b * MAX_LEN: b * MAX_LEN + st.length].int()
    for layer in range(len(states[0].keys)):
        if states[0].keys[layer] is not None:
            hkv, _, d = states[0].keys[layer].shape
            kb, vb = torch.zeros(SLOTS, hkv, d), torch.zeros(SLOTS, hkv, d)
            for b, st in enumerate(states):
                idx = req_to_token[b + 1, : st.length].long()
                kb[idx] = st.keys[layer].transpose(0, 1)  # [Hkv, P, D] -> [P, Hkv, D]
                vb[idx] = st.values[layer].transpose(0, 1)
            kv[layer] = (kb, vb)
        if states[0].conv[layer] is not None:
            km1, c = states[0].conv[layer].shape
            hv, dk, dv = states[0].recurrent[layer].shape
            cb, sb = torch.zeros(MAMBA_SLOTS, c, km1), torch.zeros(MAMBA_SLOTS, hv, dv, dk)
            for b, st in enumerate(states):
                cb[mslots[b]] = st.conv[layer].T  # [K-1, C] -> SGLang [C, K-1]
                sb[mslots[b]] = st.recurrent[layer].transpose(-1, -2)  # [HV, K, V] -> SGLang [HV, V, K]
            mamba[layer] = (cb, sb)
    return kv, mamba, req_to_token, mslots


def _stacked(mamba, axis: int = -1) -> MambaPools | None:
    """Per-layer (conv, ssm) pools -> SGLang's stacked pools (layers in order)."""
    if not mamba:
        return None
    layers = sorted(mamba)
    return MambaPools(layers, list(range(len(layers))), torch.stack([mamba[i][0] for i in layers]),
                      torch.stack([mamba[i][1] for i in layers]), axis)


def _kv_replicas(kv, tp: int) -> int:
    heads = next(iter(kv.values()))[0].shape[1]
    return max(1, tp // heads)


def _shard(kv, mamba, rank: int, tp: int, groups):
    """What tensor-parallel rank ``rank`` holds of the pools: KV heads and SSM value heads in contiguous
    blocks (with more ranks than KV heads, one head each, ``tp // heads`` consecutive ranks the same one, as
    SGLang places them), conv channels [q_r, k_r, v_r]."""
    from refcheck.sglang.capture.state import feature_index

    kv_r = {}
    replicas = _kv_replicas(kv, tp)
    for layer, (kb, vb) in kv.items():
        h = max(1, kb.shape[1] // tp)
        head = rank // replicas
        kv_r[layer] = (kb[:, head * h:(head + 1) * h], vb[:, head * h:(head + 1) * h])
    mamba_r = {}
    for layer, (cb, sb) in mamba.items():
        idx = feature_index("conv", sum(groups) // tp, rank, tp, groups)
        hv = sb.shape[1] // tp
        mamba_r[layer] = (cb[:, idx], sb[:, rank * hv:(rank + 1) * hv])
    return kv_r, mamba_r


def fake_sglang(runner, prompts, trees, layout: str, leaky: bool = False, steps: int = 4, tp: int = 1,
                full: bool = False, layer_sketches: bool = False, sampling: Sampling | None = None):
    """Run a batched fake SGLang over the given per-step trees; returns (capture, results, rids).
    ``tp`` > 1: every rank records its own shards of the state, as SGLang's TP schedulers do.
    ``sampling``: the tree steps and first tokens are REFCHECK_DDTREE's keyed sampler's (its real code)."""
    target = runner.target
    rids = {p.id: f"rid-{i}" for i, p in enumerate(prompts)}
    keys = [RequestKeys(sampling, request_key(p.id)) if sampling is not None else None for p in prompts]
    cap = Capture(steps={0: []}, prefills={0: []})
    states, roots, outputs = [], [], []
    for p, key in zip(prompts, keys):
        st, fwd = target.prefill(torch.tensor(p.prompt_ids))
        first, u = (int(fwd.logits[-1].argmax()), None) if key is None else first_token(fwd.logits[-1], key, len(p.prompt_ids))
        cap.prefills[0] += prefill_records(summarise_nodes(fwd.logits[-1:], torch.tensor([first])), torch.tensor([first]), [rids[p.id]], [len(p.prompt_ids)],
                                           None if u is None else {rids[p.id]: u})
        states.append(st)
        roots.append(first)
        outputs.append([first])
    for k in range(steps):
        tok_rows, fwds, accs = [], [], []
        parents, depths, tok_list = trees[k]
        n = len(parents)
        for b in range(len(prompts)):
            toks = tok_list[b].clone()
            toks[0] = roots[b]
            fwd = target.forward(states[b], toks, parents, depths, leaky=leaky, keep_layer_outputs=layer_sketches)
            tree = Tree(toks, parents, depths, torch.tensor(sibling_ranks(parents.tolist(), toks.tolist(), depths.tolist())),
                        torch.zeros(n))
            accs.append(tree.walk_greedy(fwd.logits.argmax(-1)))  # greedy; a sampled run's walk is the sampler's
            tok_rows.append(toks)
            fwds.append(fwd)
        logits = torch.cat([f.logits for f in fwds])  # [bs*N, V]
        rid_list = [rids[p.id] for p in prompts]
        committed = [s.length for s in states]
        if layout == "tree" and sampling is not None:
            links = [links_from_parents(parents.tolist()) for _ in prompts]
            nt, ns = torch.tensor([lk[0] for lk in links]), torch.tensor([lk[1] for lk in links])
            predict, lens, accept_index, draws, uniforms = sample_tree(logits, torch.stack(tok_rows), nt, ns, keys,
                                                                       committed, n)
            accs = [[int(i) - b * n for i in accept_index[b, : int(lens[b])]] for b in range(len(prompts))]
            recs = tree_steps(torch.cat(tok_rows), nt, ns, summarise_nodes(logits, predict), accept_index, lens, predict,
                              rid_list, committed,
                              positions=torch.cat([c + depths for c in committed]), draws=draws, uniforms=uniforms)
        elif layout == "tree":
            links = [links_from_parents(parents.tolist()) for _ in prompts]
            accept_index = torch.full((len(prompts), n), -1, dtype=torch.int32)
            predict = torch.zeros(len(prompts) * n, dtype=torch.int32)
            for b, acc in enumerate(accs):
                accept_index[b, : len(acc)] = torch.tensor([b * n + j for j in acc], dtype=torch.int32)
                for j in acc:
                    predict[b * n + j] = int(fwds[b].logits[j].argmax())
            recs = tree_steps(torch.cat(tok_rows), torch.tensor([lk[0] for lk in links]), torch.tensor([lk[1] for lk in links]),
                              summarise_nodes(logits, predict), accept_index,
                              torch.tensor([len(a) for a in accs], dtype=torch.int32), predict,
                              rid_list, committed, positions=torch.cat([c + depths for c in committed]))
        else:
            out_tokens = torch.zeros(len(prompts), n, dtype=torch.int64)
            for b, acc in enumerate(accs):
                emitted = tok_rows[b][acc[1:]].tolist() + [int(fwds[b].logits[acc[-1]].argmax())]
                out_tokens[b, : len(emitted)] = torch.tensor(emitted)
            recs = chain_steps(torch.stack(tok_rows), summarise_nodes(logits, out_tokens.reshape(-1)), torch.tensor([len(a) for a in accs], dtype=torch.int32),
                               out_tokens, rid_list, committed)
        if layer_sketches:  # what the forward hooks record: each layer's output over the flat batch of nodes
            from refcheck.sglang.capture import layers as layer_hooks

            hook = layer_hooks.hook_factory({})
            for i in range(len(target.layers)):
                out = torch.cat([f.layer_outputs[i] for f in fwds])  # [bs*N, H]
                hook(NS(layer_id=i), (), (out * 0.25, out * 0.75))  # SGLang's (hidden, residual) split
            sk = layer_hooks.take(len(prompts) * n, len(target.layers))
            for b, r in enumerate(recs):
                r.layer_sketch = sk[:, b * n:(b + 1) * n]
            layer_hooks.FORWARDS.clear()
        states = [s.commit(f, a) for s, f, a in zip(states, fwds, accs)]
        kv, mamba, req_to_token, mslots = _pools(target, states, seed=k)
        groups = (64, 64, 128)  # the built-in hybrid target: key_dim, key_dim, value_dim
        for b, r in enumerate(recs):
            slots = req_to_token[b + 1, r.committed_len: r.committed_len + len(r.accepted)]
            if tp == 1:
                r.state = request_state(batch_state(kv, slots[None], _stacked(mamba), torch.tensor([mslots[b]]),
                                                    full=full), 0, len(slots))
            roots[b] = r.bonus
            outputs[b] += r.emitted
        if tp == 1:
            cap.steps[0] += recs
            continue
        for rank in range(tp):
            kv_r, mamba_r = _shard(kv, mamba, rank, tp, groups)
            for b, r in enumerate(recs):
                copy = StepCapture.from_dict({**r.to_dict(), "state": {}, "meta": dict(r.meta)})
                slots = req_to_token[b + 1, r.committed_len: r.committed_len + len(r.accepted)]
                shard = (rank, tp, groups, _kv_replicas(kv, tp))
                copy.state = request_state(batch_state(kv_r, slots[None], _stacked(mamba_r), torch.tensor([mslots[b]]),
                                                       full=full, shard=shard), 0, len(slots))
                copy.meta.update(tp_rank=rank, tp_size=tp, conv_groups=list(groups), kv_replicas=shard[3])
                cap.steps.setdefault(rank, []).append(copy)
    results = {p.id: {"output_ids": outputs[b]} for b, p in enumerate(prompts)}
    return cap, results, rids


def fake_engine_setup():
    """(the reference runner, three prompts, the first prompt's first four trees for every prompt): what the fake
    SGLang runs (:func:`fake_sglang`)."""
    spec = EngineSpec(pair="hybrid", budget=15, drafter="scripted", max_new_tokens=64)  # accepts through decoys
    runner = ReferenceRunner(spec)
    prompts = load_prompts()[:3]
    ref_trace, _ = runner.trace(prompts[:1])
    steps = ref_trace.steps_of(prompts[0].id)
    trees = [(torch.tensor(s.tree_parents), torch.tensor(s.tree_depths),
              [torch.tensor(s.tree_tokens)] * len(prompts)) for s in steps[:4]]
    return runner, prompts, trees


def _prov(runner, prompts, budget):
    prov = runner.provenance(prompts, engine="sglang", settings={"tree_rules": "structural"})
    prov.update(drafter="none", budget=budget)
    return prov


def _replay(trace):
    return judge(trace, ReferencePool(), "fake-sglang", mode="replay")


def _sampled(cap, rule):
    """The capture a sampled run makes of the same steps: the batches the rule takes (the fake engine runs its
    requests in lockstep: its k-th batch holds every request's k-th step), numbered as the plugin numbers them, and
    the prefills when the rule takes prefill batch 0 (the fake engine prefills every request in one batch)."""
    from refcheck.sglang.capture.records import Capture

    out = Capture(steps={}, prefills=cap.prefills if rule.takes(0) else {})
    for rank, steps in cap.steps.items():
        seen: dict[str, int] = {}
        for s in steps:
            k = seen.get(s.rid, 0)
            seen[s.rid] = k + 1
            if rule.takes(k):
                s2 = StepCapture.from_dict({**s.to_dict(), "meta": {**s.meta, "step_index": k}})
                out.steps.setdefault(rank, []).append(s2)
    return out
