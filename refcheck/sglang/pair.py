"""The model pair SGLang is handed: what its checkpoints' configs say, and the refusals before any engine starts.

Contract: reads only the target's and the draft's ``config.json`` (a multimodal target's ``text_config``):
:func:`draft_block_size`, :func:`is_hybrid_target`, :func:`target_context`; :func:`resolve_budget` gives the verify
budget an algorithm runs with and :func:`check_ddtree_pair` / :func:`check_context` refuse what SGLang could not run
(:class:`~refcheck.errors.UsageError`, exit 2; a draft that does not fit its target:
:class:`~refcheck.errors.ModelError`). :data:`DFLASH_DRAFTED` names the algorithms that draft with the DFlash
checkpoint. No SGLang import.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree_reference.drafter import dflash_value
from refcheck.errors import ModelError, UsageError
from refcheck.prompts import Prompt
from refcheck.reference_runner import EngineSpec
from refcheck.sglang.ddtree.faults import ALGORITHMS as FAULT_ALGORITHMS
from refcheck.sglang.ddtree.shadow import SHADOW_NAME

# algorithms whose drafts come from the DFlash draft checkpoint (refcheck's DDTree and its leaky and faulty twins)
SHADOW = SHADOW_NAME
DFLASH_DRAFTED = ("DFLASH", "REFCHECK_DDTREE", "REFCHECK_DDTREE_LEAKY_CHAIN", SHADOW, *FAULT_ALGORITHMS)


#: SGLang's tree-verify metadata kernel (``reconstruct_indices_from_tree_mask``) launches one CUDA thread
#: per draft token of a request, so a tree is at most 1024 tokens: the root and 1023 drafted nodes
MAX_TREE_TOKENS = 1024


def checkpoint_config(path: Path | None) -> dict:
    """A checkpoint's config.json, or {} where there is none."""
    f = Path(path) / "config.json" if path is not None else None
    return json.loads(f.read_text()) if f is not None and f.is_file() else {}


def text_config_of(cfg: dict) -> dict:
    """The language model's part of a target's config (a multimodal checkpoint nests it as text_config)."""
    return cfg.get("text_config", cfg)


def _text_config(target_dir: Path | None) -> dict:
    """The language model's config of a target."""
    return text_config_of(checkpoint_config(target_dir))


def draft_block_size(draft_dir: Path | None) -> int | None:
    size = dflash_value(checkpoint_config(draft_dir), "block_size")
    return int(size) if size is not None else None


def hybrid_config(text_cfg: dict) -> bool:
    return "linear_attention" in (text_cfg.get("layer_types") or [])


def is_hybrid_target(target_dir: Path) -> bool:
    """Whether the target has recurrent (linear-attention) layers, by its config."""
    return hybrid_config(_text_config(target_dir))


def check_ddtree_pair(algorithm: str, budget: int, target_dir: Path | None, draft_dir: Path | None) -> None:
    """Refusals for refcheck's DDTree algorithms before any engine starts (the scheduler would
    otherwise die at start-up, or worse, run something else): the tree size SGLang can verify, a
    DFlash draft made for this target, and a hybrid target for the chain-layout leak."""
    if budget + 1 > MAX_TREE_TOKENS:
        raise UsageError(f"--budget {budget} is beyond SGLang's tree verify: at most {MAX_TREE_TOKENS} tokens per "
                         f"tree (its reconstruct_indices_from_tree_mask kernel runs one thread per token), "
                         f"i.e. --budget <= {MAX_TREE_TOKENS - 1}")
    dcfg = checkpoint_config(draft_dir)
    if "dflash_config" not in dcfg:
        raise ModelError(f"{algorithm} drafts with a DFlash checkpoint, and {draft_dir} is not one "
                         "(its config.json has no dflash_config)")
    tcfg = _text_config(target_dir)
    layers = tcfg.get("num_hidden_layers")
    wanted = dflash_value(dcfg, "num_target_layers")
    problems = []
    if layers is not None and wanted is not None and int(wanted) != int(layers):
        problems.append(f"it was made for a {wanted}-layer target, this target has {layers} layers")
    ids = dflash_value(dcfg, "target_layer_ids") or []
    if layers is not None and ids and max(ids) >= int(layers):
        problems.append(f"it reads target layers {ids}, beyond the target's {layers}")
    for key in ("hidden_size", "vocab_size"):
        if key in tcfg and key in dcfg and int(tcfg[key]) != int(dcfg[key]):
            problems.append(f"its {key} is {dcfg[key]}, the target's {tcfg[key]}")
    if problems:
        raise ModelError(f"the draft {draft_dir} does not fit the target {target_dir}: " + "; ".join(problems))
    if algorithm == "REFCHECK_DDTREE_LEAKY_CHAIN" and target_dir is not None and not is_hybrid_target(target_dir):
        raise UsageError(f"{algorithm} demonstrates the leak of trees run through recurrent layers in their chain "
                         f"layout; {target_dir} has no linear-attention layers, so it would verify correctly and "
                         "show nothing (use a hybrid target, e.g. --pair hybrid)")


def resolve_budget(algorithm: str, budget: int | None, draft_dir: Path | None, target_dir: Path | None = None) -> int:
    """The verify budget (drafted nodes per step) an algorithm runs with; refuses mismatches."""
    if algorithm == "NONE":
        return 0
    if algorithm == "DFLASH":
        block = draft_block_size(draft_dir)
        if block is None:
            raise UsageError(f"DFLASH needs a DFlash draft checkpoint with dflash_config.block_size ({draft_dir})")
        if budget is not None and budget != block - 1:
            raise UsageError(f"--budget {budget} does not match the draft's block size {block}: SGLang's DFLASH "
                             f"verifies whole blocks, i.e. budget {block - 1} (block size - 1)")
        return block - 1
    if budget is None:
        raise UsageError(f"{algorithm} verifies trees of a node budget: pass --budget N (chain mode is DFLASH)")
    if budget < 1:
        raise UsageError(f"{algorithm} needs --budget >= 1, got {budget}")
    if algorithm in DFLASH_DRAFTED:  # refcheck's DDTree algorithms
        check_ddtree_pair(algorithm, budget, target_dir, draft_dir)
    return budget


def target_context(target_dir: Path | None) -> int | None:
    """The positions a target's context holds (its config's ``max_position_embeddings``), None where unsaid."""
    context = _text_config(target_dir).get("max_position_embeddings")
    return int(context) if context is not None else None


def check_context(prompts: list[Prompt], spec: EngineSpec, target_dir: Path | None) -> None:
    """Refuse a prompt whose tokens and new tokens do not fit the target's context (its max_position_embeddings)."""
    context = target_context(target_dir)
    if context is None:
        return
    for p in prompts:
        need = len(p.prompt_ids) + (p.max_new_tokens or spec.max_new_tokens)
        if need > context:
            raise UsageError(f"prompt {p.id!r}: {len(p.prompt_ids)} prompt tokens + {p.max_new_tokens or spec.max_new_tokens} "
                             f"new tokens exceed the target's context of {context} positions ({target_dir}: "
                             "max_position_embeddings)")
