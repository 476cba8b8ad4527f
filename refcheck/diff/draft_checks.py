"""A replayed step's drafter side: the tree its drafts give, the context it fed its drafter, and its τ beside the
reference's.

Contract: three functions over one replayed request (:class:`refcheck.diff.request_replay.RequestReplay`, read through
the few attributes :class:`ReplayedRequest` names), each called once per step by the replay:

* :func:`check_drafted_tree` (category ``tree``): the tree the engine verified (and, in shadow mode, the tree its
  drafter built) must be what its drafting rule builds from its *own* recorded draft top-k
  (:mod:`refcheck.diff.drafted_tree`); a difference at a path-score near-tie is a benign tie with its margin;
* :func:`check_context` (category ``draft``): the positions the engine fed its drafter's context from this step
  must be the root's and the accepted nodes' (``committed_len + depth``, in path order), and the sketch of the
  target features fed with them must match the reference's (the dtype's tensor bound: rel L2 and cosine);
* :func:`reference_tau`: the reference's τ at the engine's prefix under the engine's drafting rule (the reference
  drafter's draft, the rule's tree, the reference's greedy walk), for the acceptance account
  (:mod:`refcheck.diff.acceptance`); one extra target forward where that tree is not the engine's.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from ddtree_reference.state import TargetState
from ddtree_reference.target import Target
from ddtree_reference.tree import Tree, build_chain, build_ddtree
from refcheck.diff.acceptance import DraftRule
from refcheck.diff.drafted_tree import compare, rebuild
from refcheck.diff.findings import Finding, Report, Verdict
from refcheck.diff.sampling import SampledRequest
from refcheck.diff.tolerance import Tolerance
from refcheck.profile import phase
from refcheck.sketch import cosine, rel_l2, sketch_rows
from refcheck.trace.rows import StepRow


class ReplayedRequest(Protocol):
    rep: Report
    rid: str
    tol: Tolerance
    target: Target
    state: TargetState
    draft_rule: DraftRule
    sampled: SampledRequest | None
    ref_draft: torch.Tensor | None
    tree_margin: tuple[float, int] | None

    def fail(self, category: str, step: int | None, message: str, **kw: Any) -> None: ...


def _trees(s: StepRow, rule: str) -> list[tuple[str, list[int], list[int], str]]:
    """(what, tokens, parents, rule) of each tree the step's draft must give."""
    if s.shadow_tree_tokens:  # shadow mode: the drafter's tree by the DDTree rule, the verified chain by the chain rule
        return [("shadow tree", list(s.shadow_tree_tokens), list(s.shadow_tree_parents), "ddtree"),
                ("verified chain", list(s.tree_tokens), list(s.tree_parents), "chain")]
    return [("tree", list(s.tree_tokens), list(s.tree_parents), rule)]


def check_drafted_tree(r: ReplayedRequest, s: StepRow) -> None:
    """The engine's trees against what its drafting rule builds from its own recorded draft (module docstring)."""
    rule = r.draft_rule
    if rule.name not in ("ddtree", "chain") or not s.draft_topk_ids:
        return
    if r.sampled is not None and r.sampled.sampling.temperature != 1.0:
        # the tree is built from the draft at the request's temperature, which the top-k cannot renormalise
        r.rep.stats["tree_rebuild_sampled"] = r.rep.stats.get("tree_rebuild_sampled", 0) + 1
        return
    for what, tokens, parents, how in _trees(s, rule.name):
        if not tokens or len(tokens) != len(parents):
            continue  # a malformed tree: the tree check of the replay reports it
        rebuilt = rebuild(how, tokens[0], s.draft_topk_ids, s.draft_topk_logprobs, rule.vocab, rule.budget)
        if rebuilt is None:
            r.rep.stats["tree_rebuild_undecided"] = r.rep.stats.get("tree_rebuild_undecided", 0) + 1
            continue
        r.rep.check("tree")
        diff = compare(tokens, parents, rebuilt, s.draft_topk_ids, s.draft_topk_logprobs)
        if diff is None:
            continue
        details = {"engine_path": list(diff.engine_only), "rebuilt_path": list(diff.rebuilt_only), "margin": diff.margin,
                   "rule": how}
        if diff.near_tie:
            r.rep.add(Finding(Verdict.BENIGN_TIE, "tree", r.rid, s.step, details=details,
                              message=f"{what}: {diff.describe()}: a near-tie of path scores"))
        else:
            r.fail("tree", s.step, f"{what} is not the {how} tree of the engine's own drafts: {diff.describe()}",
                   details=details)


def check_context(r: ReplayedRequest, s: StepRow, tree: Tree, context: torch.Tensor, prev: int) -> None:
    """What the engine fed its drafter from this step: positions and target features (``context`` [N, F]: the
    reference's features of every node of the step's tree; ``prev`` the committed length before the step)."""
    if not s.draft_context_positions and s.draft_context_sketch is None:
        return
    r.rep.check("draft")
    want = [prev + int(tree.depths[a]) for a in s.accepted]
    got = list(s.draft_context_positions)
    if got and got != want:
        r.fail("draft", s.step, f"the engine fed its drafter's context at positions {got}; the root and the accepted "
               f"nodes are at {want}", details={"engine": got, "reference": want})
        return
    sk = s.draft_context_sketch
    if sk is None:
        return
    acc = torch.tensor(s.accepted, dtype=torch.long, device=context.device)
    ref = sketch_rows(context[acc])  # [A, r]
    if tuple(sk.shape) != tuple(ref.shape):
        r.fail("draft", s.step, f"the engine fed its drafter {sk.shape[0]} context rows of sketch width "
               f"{sk.shape[-1] if sk.dim() == 2 else '?'}; the root and the accepted nodes are {ref.shape[0]} rows",
               details={"engine_rows": int(sk.shape[0]), "reference_rows": int(ref.shape[0])})
        return
    if not bool(torch.isfinite(sk).all()):
        r.fail("draft", s.step, "the sketch of the features fed to the drafter holds non-finite values (NaN or Inf)")
        return
    err, cos = rel_l2(sk.float(), ref), cosine(sk.float(), ref)
    r.rep.stats["max_rel_l2_draft_context"] = max(r.rep.stats.get("max_rel_l2_draft_context", 0.0), err)
    if err > r.tol.tensor_rel_l2 or cos < r.tol.tensor_min_cos:
        r.fail("draft", s.step, f"the target features fed to the drafter differ from the reference's: rel L2 {err:.3g}, "
               f"cosine {cos:.6f} (tolerance {r.tol.tensor_rel_l2:g} / {r.tol.tensor_min_cos:g}); wrong layers or rows?",
               details={"rel_l2": err, "cosine": cos})


def _forward_walk(r: ReplayedRequest, tree: Tree) -> list[int]:
    with phase("replay.account"):  # its own phase: the step's one verify forward stays countable as such
        fwd = r.target.forward(r.state, tree.tokens, tree.parents, tree.depths)
    return tree.walk_greedy(fwd.logits.argmax(dim=-1).cpu())


def reference_tree(r: ReplayedRequest, s: StepRow, root: int) -> Tree | None:
    """The tree the engine's drafting rule builds from the reference drafter's draft at this step (None: no rule,
    or no reference draft)."""
    rule, lp = r.draft_rule, r.ref_draft
    if lp is None:
        return None
    if rule.name == "chain":
        return build_chain(root, lp)
    if rule.name == "ddtree" and rule.budget is not None:
        return build_ddtree(root, lp, rule.budget)
    return None


def reference_tau(r: ReplayedRequest, s: StepRow, tree: Tree, logp: torch.Tensor
                  ) -> tuple[int, bool, bool] | None:
    """(τ of the reference's own step at the engine's prefix, whether its tree differs from the engine's, whether
    the walk on the engine's tree parted from the engine's at a tie the checks excused); None: not accounted."""
    rule = r.draft_rule
    if r.sampled is not None or rule.name == "other" or not rule.comparable:
        return None
    pure = tree.walk_greedy(logp.argmax(dim=-1).cpu())  # the reference's own walk, no teacher forcing at ties
    tie = pure != list(s.accepted)
    if rule.name == "none":
        return 1, tree.num_nodes != 1, tie
    ref_tree = reference_tree(r, s, int(s.tree_tokens[0]))
    if ref_tree is None:
        return None
    diff = compare(s.tree_tokens, s.tree_parents, ref_tree, [], [])
    if diff is None:
        return len(pure), False, tie
    r.tree_margin = _reference_margin(r.ref_draft, diff.engine_only, diff.rebuilt_only)
    return len(_forward_walk(r, ref_tree)), True, tie


def _reference_margin(lp: torch.Tensor | None, engine_path: tuple[int, ...], ref_path: tuple[int, ...]) -> tuple[float, int]:
    """(how much better the reference's draft scores the path the reference took than the one the engine took,
    the longer path's depth): what the engine's draft deviation must explain for the trees to part at a near-tie."""
    if lp is None or not engine_path or not ref_path or max(len(engine_path), len(ref_path)) > lp.shape[0]:
        return math.inf, 0

    def score(path: tuple[int, ...]) -> float:
        return float(sum(lp[d, t] for d, t in enumerate(path)))

    return score(ref_path) - score(engine_path), max(len(engine_path), len(ref_path))


def shadow_tau(r: ReplayedRequest, s: StepRow) -> int | None:
    """τ the engine's shadow tree would have had under the reference's verify at this prefix (None: no shadow tree)."""
    if not s.shadow_tree_tokens or r.sampled is not None:
        return None
    n = len(s.shadow_tree_tokens)
    try:
        tree = Tree(torch.tensor(s.shadow_tree_tokens), torch.tensor(s.shadow_tree_parents),
                    _depths(s.shadow_tree_parents), torch.zeros(n, dtype=torch.long), torch.zeros(n))
        tree.validate(structural_only=True)
    except (ValueError, RuntimeError):
        return None
    return len(_forward_walk(r, tree))


def _depths(parents: list[int]) -> torch.Tensor:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return torch.tensor(d, dtype=torch.long)
