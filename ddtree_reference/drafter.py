"""DFlash block-diffusion drafter (z-lab checkpoint layout) and the drafter interface.

Contract: a drafter proposes, for the block that starts at the bonus token ``b`` at position
``start``, one distribution per depth 1..L (L = block_size - 1), each a *marginal* that is not
conditioned on the other drafts: ``propose(bonus, start) -> [L, V]`` float32 log-probs. After each
verify step the decoder calls ``extend(context, positions)`` with the target's hidden states
(after ``target_layer_ids``) of the committed root + accepted nodes only, never the bonus or
rejected nodes.

:class:`DFlashDrafter` reads a z-lab DFlash checkpoint: ``config.json`` (Qwen3 fields plus
``dflash_config`` with ``mask_token_id``, ``target_layer_ids``, ``block_size``) and safetensors
``layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``, ``mlp.*``, ``fc``,
``hidden_norm``, ``norm`` (optionally under ``model.``). Token embeddings and LM head are the target's
(a checkpoint's own are ignored). Loading is strict: a tensor missing, unexpected, of the wrong shape
or not floating point is refused by name (ddtree_reference/checkpoint.py). The input block is
``[b, MASK × (L)]``; the context (``hidden_norm(fc(target hidden))``) gives extra keys/values to
every layer, kept in a per-request cache; the block's own keys/values never persist. Attention
inside the block is non-causal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ddtree_reference.checkpoint import TensorInfo, read_tensor_index, state_report
from ddtree_reference.errors import CheckpointError, ModelMismatchError
from ddtree_reference.layers import apply_rope, repeat_heads
from ddtree_reference.target import Target


class Drafter(Protocol):
    """What the DDTree decoder needs from a drafter (DFlash, scripted, or an engine's own)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]

    def reset(self) -> None: ...

    def extend(self, context: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None: ...

    def propose(self, bonus: int, start: int, depth: int | None = None) -> torch.Tensor: ...


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's spread of context layers over 1 .. L-3 (z-lab's convention)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_value(cfg: dict, name: str, default=None):
    """A DFlash setting of a draft config: ``dflash_config`` first, then the top level (older checkpoints)."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def _draft_name(name: str) -> str | None:
    """The drafter's state name of a draft checkpoint tensor; None for the target's embeddings and LM head,
    which some DFlash checkpoints carry and the drafter takes from the target instead."""
    name = name.removeprefix("model.")
    return None if name.startswith(("lm_head", "embed_tokens")) else name


def read_draft_weights(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of draft checkpoint ``path`` under the drafter's names, after checking them against
    ``state`` (every tensor present, none unexpected, shapes equal, floating point: ddtree_reference/checkpoint.py)."""
    index: dict[str, TensorInfo] = {}
    for name, info in read_tensor_index(path, "draft").items():
        new = _draft_name(name)
        if new in index:
            raise CheckpointError(f"draft checkpoint {path}: tensor {new} is there twice (with and without 'model.')")
        if new is not None:
            index[new] = info
    state_report(index, state).raise_if_bad(f"draft checkpoint {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            tensors = load_file(str(f))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"cannot read draft weights {f}: {exc}") from exc
        weights.update({new: t for name, t in tensors.items() if (new := _draft_name(name)) is not None})
    return weights


class DFlashDrafter(nn.Module):
    """A DFlash draft model with its own context cache, evaluated in pure PyTorch."""

    def __init__(self, cfg: dict, target: Target) -> None:
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.cfg = cfg
        qcfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("dflash_config", "architectures")})
        self.qcfg = qcfg
        self.target = target
        #: applied to the block's residual stream after each add when set (None: exact); see Target
        self.residual_rounding: Callable[[torch.Tensor], torch.Tensor] | None = None
        h, eps = qcfg.hidden_size, qcfg.rms_norm_eps
        self.head_dim: int = getattr(qcfg, "head_dim", None) or h // qcfg.num_attention_heads
        self.n_heads: int = qcfg.num_attention_heads
        self.n_kv: int = qcfg.num_key_value_heads
        n_target = cfg.get("num_target_layers", len(target.layers))
        self.target_layer_ids: list[int] = list(
            dflash_value(cfg, "target_layer_ids", default_target_layer_ids(n_target, qcfg.num_hidden_layers))
        )
        self.block_size = int(dflash_value(cfg, "block_size", 16))
        mask = dflash_value(cfg, "mask_token_id")
        if mask is None:
            raise CheckpointError("draft config has no dflash_config.mask_token_id")
        self.mask_token_id = int(mask)
        self.embed_scale = float(dflash_value(cfg, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(cfg, "output_multiplier", 1.0))
        softcap = dflash_value(cfg, "final_logit_softcapping")
        self.softcap = float(softcap) if softcap else 0.0

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=bool(qcfg.attention_bias))

        layers = []
        for _ in range(qcfg.num_hidden_layers):
            layer = nn.Module()
            attn = nn.Module()
            attn.q_proj = lin(h, self.n_heads * self.head_dim)
            attn.k_proj = lin(h, self.n_kv * self.head_dim)
            attn.v_proj = lin(h, self.n_kv * self.head_dim)
            attn.o_proj = lin(self.n_heads * self.head_dim, h)
            attn.q_norm = Qwen3RMSNorm(self.head_dim, eps=eps)
            attn.k_norm = Qwen3RMSNorm(self.head_dim, eps=eps)
            layer.self_attn = attn
            layer.mlp = Qwen3MLP(qcfg)
            layer.input_layernorm = Qwen3RMSNorm(h, eps=eps)
            layer.post_attention_layernorm = Qwen3RMSNorm(h, eps=eps)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=eps)
        self.norm = Qwen3RMSNorm(h, eps=eps)
        # Float32 in every model dtype (:meth:`load` casts the rest): the angle at position p is p x inv_freq, so an
        # inv_freq rounded to bf16 (relative error up to 2^-8) turns it by up to p x 2^-8 x inv_freq, radians at a few
        # hundred tokens; engines keep the frequencies in float32 and round only the cos/sin values.
        self.rotary_emb = Qwen3RotaryEmbedding(qcfg)
        self.reset()

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, target: Target) -> DFlashDrafter:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"draft checkpoint directory not found: {path}")
        try:
            cfg = json.loads((path / "config.json").read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(f"no config.json in draft checkpoint directory {path}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"malformed config.json in draft checkpoint {path}: {exc}") from exc
        if not isinstance(cfg, dict) or "hidden_size" not in cfg:
            raise CheckpointError(f"draft config.json in {path} has no hidden_size")
        if cfg["hidden_size"] != target.hidden_size:
            raise ModelMismatchError(
                f"draft hidden size {cfg['hidden_size']} != target hidden size {target.hidden_size}"
            )
        if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
            raise ModelMismatchError(f"draft vocab {cfg['vocab_size']} != target vocab {target.vocab_size}")
        if not any(path.glob("*.safetensors")):
            raise CheckpointError(f"no *.safetensors weights in draft checkpoint directory {path}")
        model = cls(cfg, target)
        bad = [i for i in model.target_layer_ids if not 0 <= i < len(target.layers)]
        if bad:
            raise ModelMismatchError(f"draft target_layer_ids {bad} outside the target's {len(target.layers)} layers")
        model.load_state_dict(read_draft_weights(path, model.checkpoint_state()), strict=False)
        model.to(device=target.device)
        for child in model.children():  # the target's dtype, the rotary tables aside
            if child is not model.rotary_emb:
                child.to(dtype=target.dtype)
        return model.eval()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers a draft checkpoint provides (all but the rotary tables,
        computed from the config)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb")}

    # -- context cache --------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the request's context (call at the start of every request)."""
        self.ctx_keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self.ctx_values: list[torch.Tensor | None] = [None] * len(self.layers)
        self.ctx_len = 0

    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(like.unsqueeze(0), positions.view(1, -1))
        return cos[0], sin[0]  # [n, D]

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the keys and values ([Hkv, n, D] each) that target hidden states
        ([n, len(target_layer_ids)*H]) at ``positions`` ([n]) add to the context."""
        ctx = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))  # [n, H]
        cos, sin = self._rope(positions.to(ctx.device), ctx)
        n = ctx.shape[0]
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(n, self.n_kv, self.head_dim)).transpose(0, 1)  # [Hkv, n, D]
            v = attn.v_proj(ctx).view(n, self.n_kv, self.head_dim).transpose(0, 1)
            out.append((apply_rope(k, cos, sin), v))
        return out

    @torch.no_grad()
    def extend(self, context: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Append target hidden states ([n, len(target_layer_ids)*H]) at ``positions`` ([n])."""
        for i, (k, v) in enumerate(self.context_kv(context, positions)):
            if self.ctx_keys[i] is None:
                self.ctx_keys[i], self.ctx_values[i] = k, v
            else:
                self.ctx_keys[i] = torch.cat([self.ctx_keys[i], k], dim=1)
                self.ctx_values[i] = torch.cat([self.ctx_values[i], v], dim=1)
        self.ctx_len += context.shape[0]

    # -- proposal ---------------------------------------------------------------------------------
    def block_hidden(self, ids: torch.Tensor, positions: torch.Tensor,
                     context: list[tuple[torch.Tensor, torch.Tensor] | None],
                     context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [bs, H] of the block ``ids`` ([bs]) at ``positions`` ([bs]),
        attending (non-causally) to the whole block and to each layer's context keys/values
        ([Hkv, P, D] each, or None for none); ``context_valid`` [P] bool marks the context slots that
        hold tokens (fixed-size caches, ddtree_reference/static_draft.py), None = all."""
        bs = ids.shape[0]
        h = F.embedding(ids, self.target.body.embed_tokens.weight) * self.embed_scale  # [bs, H]
        cos, sin = self._rope(positions, h)
        mask = None  # [1, 1, 1, ctx+bs]: the same for every layer
        if context_valid is not None:
            mask = torch.cat([context_valid, torch.ones(bs, dtype=torch.bool, device=ids.device)])[None, None, None, :]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(bs, self.n_heads, self.head_dim)).transpose(0, 1)  # [Hq, bs, D]
            k = attn.k_norm(attn.k_proj(x).view(bs, self.n_kv, self.head_dim)).transpose(0, 1)  # [Hkv, bs, D]
            v = attn.v_proj(x).view(bs, self.n_kv, self.head_dim).transpose(0, 1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if context[i] is not None:
                ck, cv = context[i]
                k = torch.cat([ck, k], dim=1)  # [Hkv, ctx+bs, D]
                v = torch.cat([cv, v], dim=1)
            rep = self.n_heads // self.n_kv
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), repeat_heads(k, rep).unsqueeze(0), repeat_heads(v, rep).unsqueeze(0),
                attn_mask=mask if context[i] is not None else None, scale=self.head_dim**-0.5,
            )[0]  # [Hq, bs, D], non-causal: every block position sees the whole block and context
            h = h + attn.o_proj(out.transpose(0, 1).reshape(bs, -1))
            if self.residual_rounding is not None:
                h = self.residual_rounding(h)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if self.residual_rounding is not None:
                h = self.residual_rounding(h)
        return self.norm(h)

    @torch.no_grad()
    def hidden(self, bonus: int, start: int, depth: int | None = None) -> torch.Tensor:
        """Final-norm hidden states [1+depth, H] of the block ``[bonus, MASK × depth]`` at ``start``.

        depth defaults to block_size - 1. A shorter block (the last step before max_new_tokens) is
        what z-lab's dflash_generate runs, and its drafts differ: the block attends to itself.
        """
        dev = self.fc.weight.device
        bs = self.block_size if depth is None else min(depth + 1, self.block_size)
        ids = torch.full((bs,), self.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = bonus
        context = [None if k is None else (k, v) for k, v in zip(self.ctx_keys, self.ctx_values)]
        return self.block_hidden(ids, torch.arange(start, start + bs, device=dev), context)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, V] float32 of block hidden states [n, H] (cast for a dtype-free tree builder)."""
        logits = self.target.model.lm_head(hidden).float() * self.output_multiplier
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def logits(self, bonus: int, start: int, depth: int | None = None) -> torch.Tensor:
        """Draft logits for depths 1..depth: [depth, V] float32."""
        return self.logits_of(self.hidden(bonus, start, depth)[1:])

    def propose(self, bonus: int, start: int, depth: int | None = None) -> torch.Tensor:
        return torch.log_softmax(self.logits(bonus, start, depth), dim=-1)
