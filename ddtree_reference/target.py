"""The target model: prefill, exact tree verify and commit over transformers' decoder layers.

Contract: :class:`Target` wraps a transformers causal LM of type ``qwen3`` (attention only),
``qwen3_5`` / ``qwen3_5_text`` (hybrid: Gated DeltaNet + full attention, the Qwen3.5 / Qwen3.6
architecture) or ``qwen3_next``. It calls the model's own modules (embeddings, norms, MLPs, the
attention and Gated DeltaNet weights) through :mod:`ddtree_reference.layers`, never the model's forward,
so the reference owns the tree semantics and the state layout while the weights and numerics stay
the library's. ``Target.load`` is strict: a checkpoint that lacks a tensor of the model, holds one it has
no place for, or one of the wrong shape or a non-floating-point dtype is refused by name
(:class:`~ddtree_reference.errors.CheckpointTensorsError`, ddtree_reference/checkpoint.py), never run with random
weights. ``forward`` evaluates n nodes below a committed :class:`TargetState`; a prefill is
a chain, a verify is a draft tree. Node positions are ``state.length + depth`` (siblings share a
position). ``commit`` never re-runs the model.

Exactness: on fp32 CPU, logits equal a plain cache-free forward of the same token path through the
HF model to ~1e-6 (tests/test_target.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddtree_reference.checkpoint import read_tensor_index, transformers_files, transformers_report
from ddtree_reference.compat import rope_position_ids
from ddtree_reference.errors import CheckpointError, PromptError, UnsupportedModelError
from ddtree_reference.fused import MLP, UNFUSED, LayerFusion, fuse_layer, project
from ddtree_reference.layers import TreePlan, attention_tree, conv_window_rows, deltanet_tree
from ddtree_reference.state import TargetState, TreeForward
from ddtree_reference.treechunk import ancestor_matrix, checks_enabled, unchecked

SUPPORTED_MODEL_TYPES = frozenset({"qwen3", "qwen3_5", "qwen3_5_text", "qwen3_next"})
PREFILL_CHUNK = 64  # prompt tokens per prefill forward


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory, with a CheckpointError for every way it can be bad."""
    cfg_path = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {path}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"malformed config.json in {path}: {exc}") from exc
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CheckpointError(f"config.json in {path} has no model_type")
    if not any(Path(path).glob("*.safetensors")):
        raise CheckpointError(f"no *.safetensors weights in checkpoint directory {path}")
    return cfg


def _from_pretrained(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers' causal LM of ``path`` and its loading report (missing, unexpected and mismatched
    tensors are reported there, not raised: the caller refuses them by name)."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load target checkpoint {path}: {exc}") from exc
    return model, dict(info)


class Target:
    """A target causal LM evaluated over trees with explicit, exact state."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.config = model.config
        self.model_type: str = self.config.model_type
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {self.model_type!r} is not supported (supported: {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        self.body: Any = model.model  # the transformers model body (typed by transformers only dynamically)
        self.layers = list(self.body.layers)
        self.layer_types: list[str] = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        )
        self.vocab_size: int = self.config.vocab_size
        self.hidden_size: int = self.config.hidden_size
        self.max_positions: int = self.config.max_position_embeddings
        #: how Gated DeltaNet layers evaluate a tree: "levels" (depth by depth) or "chunk" (one
        #: ancestor-masked chunk of the chunked delta rule, fast on GPUs); both exact.
        self.gdn_method: str = "chunk"
        # One decoder layer of a forward; :meth:`compile` swaps in a torch.compile'd version.
        self._layer_fn: Callable[..., tuple[torch.Tensor, Any]] = decoder_layer
        self.compiled = False
        self.fusions: list[LayerFusion] = [UNFUSED] * len(self.layers)  # per layer; :meth:`compile` fuses
        #: applied to the residual stream after each add when set (None: exact). refcheck's rounding ensemble
        #: sets it to emulate an engine that stores the residual stream in its own dtype.
        self.residual_rounding: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: the Gated DeltaNet layers' conv kernel sizes (their window rows are planned once per forward)
        self.conv_kernels: list[int] = sorted({int(self.layers[i].linear_attn.conv_kernel_size)
                                               for i in range(len(self.layers)) if self.is_linear(i)})

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Target:
        """The target of checkpoint directory ``path``, in ``dtype`` on ``device``.

        Strict: every parameter and persistent buffer of the model comes from the checkpoint with
        its shape, and the checkpoint holds nothing the model has no place for (tensors the model's
        class skips on purpose, e.g. a vision tower, excepted), else CheckpointTensorsError naming
        the tensors (ddtree_reference/checkpoint.py)."""
        path = Path(path)
        cfg = read_config(path)
        if cfg["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{path}: model type {cfg['model_type']!r} is not supported "
                f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        index = read_tensor_index(path, "target", transformers_files(path))
        model, info = _from_pretrained(path, dtype)
        transformers_report(info, index, model.state_dict()).raise_if_bad(f"target checkpoint {path}")
        return cls(model.to(device))

    @property
    def device(self) -> torch.device:
        return self.body.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    def compile(self) -> None:
        """The fast path: fused projections and each decoder layer through ``torch.compile``.

        Two changes, both equal to the eager reference up to float rounding, never bit for bit:

        * every layer's projections that read one input become one GEMM (``in_proj_qkv | z | b | a``,
          ``q | k | v``, ``gate | up``: :func:`ddtree_reference.fused.fuse_layer`; the weights stay held once).
          This applies to every later forward of this target, eager ones included (the model's modules
          are re-pointed at the fused rows but compute what they did: another target sharing the model
          is unaffected);
        * each decoder layer (norms, token mixer, residual adds, MLP) runs as one Inductor graph
          (static shapes): the dozens of small elementwise kernels per layer (norms, gates, conv,
          l2-norm, decay, RoPE) that otherwise cost more than the weights take to stream at one to 65
          tokens are fused, across the layer's seams too. The math is the eager code's, traced (no
          graph breaks). Every layer of a kind shares one compiled graph (parameters and the fused
          weights are graph inputs); each new node count compiles once.

        The eager path stays the reference; this one is for speed at scale (tests/test_target.py,
        scripts/bench_verify.py). Compiled layers serve forwards without host-side checks
        (``validate=False``: the graphed step, the benchmark); a validated forward (prefill, the
        decoder's checks) runs the eager layers (on the fused weights).
        """
        if self.compiled:  # once: a second fusion would copy the fused weights again
            return
        import torch._dynamo
        import torch._inductor.config

        # Inductor's mm-padding pass benchmarks with random tensors while compiling, which trips
        # CUDA-graph RNG bookkeeping; these matmuls go to cuBLAS unpadded anyway.
        torch._inductor.config.shape_padding = False

        # one graph per (layer kind, node count, tree-plan cache state): budgets 15 and 64, decode,
        # prefill chunks and the leaky variant need more than dynamo's default of 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.fusions = [fuse_layer(layer) for layer in self.layers]
        self._layer_fn = torch.compile(decoder_layer, dynamic=False)
        self.compiled = True

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    # -- state --------------------------------------------------------------------------------
    def empty_state(self) -> TargetState:
        n = len(self.layers)
        keys: list[torch.Tensor | None] = [None] * n
        values: list[torch.Tensor | None] = [None] * n
        conv: list[torch.Tensor | None] = [None] * n
        rec: list[torch.Tensor | None] = [None] * n
        for i, layer in enumerate(self.layers):
            if self.is_linear(i):
                gdn = layer.linear_attn
                conv[i] = torch.zeros(gdn.conv_kernel_size - 1, gdn.conv_dim, dtype=self.dtype, device=self.device)
                rec[i] = torch.zeros(
                    gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, dtype=torch.float32, device=self.device
                )
            else:
                attn = layer.self_attn
                n_kv = attn.k_proj.out_features // attn.head_dim
                keys[i] = torch.zeros(n_kv, 0, attn.head_dim, dtype=self.dtype, device=self.device)
                values[i] = keys[i].clone()
        return TargetState(0, keys, values, conv, rec)

    # -- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        state: TargetState,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        capture: list[int] | tuple[int, ...] = (),
        leaky: bool = False,
        keep_layer_outputs: bool = False,
        validate: bool = True,
        recurrent_parents: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        conv_parents: torch.Tensor | None = None,
    ) -> TreeForward:
        """Evaluate n nodes below ``state``.

        tokens/parents/depths: [n] int64; parents[t] < t, -1 = attached to the committed prefix;
        depths[t] >= 0 with position = state.length + depths[t]. ``capture`` lists target layer ids
        whose outputs (hidden state after that layer) are concatenated into ``context``.
        ``leaky`` runs the recurrent layers over the flattened order (a known engine bug).
        ``validate=False`` skips the host-side input checks (for CUDA-graph capture, where reading a
        device value on the host is not allowed); with the "chunk" method the forward then never
        synchronises.

        Counterfactuals (``refcheck explain``): ``recurrent_parents`` [n] replaces the parents the
        Gated DeltaNet layers follow (conv windows and recurrent state), ``visible`` [n, n] bool the
        attention layers' ancestor-or-self mask; the other layers keep the tree's own.
        ``conv_parents`` [n] replaces only the parents the Gated DeltaNet conv windows follow (each
        window is the K-1 rows before a node along ``conv_parents``; the recurrence keeps the tree's
        parents): injected engine faults (refcheck/selftest/faults.py) use it. Every override is None
        by default and then costs nothing.
        """
        dev = self.device
        tokens, parents, depths = (t.to(dev, torch.long) for t in (tokens, parents, depths))
        n = tokens.shape[0]
        if n == 0:
            raise PromptError("nothing to evaluate: zero tokens")
        positions = state.length + depths  # [n]
        if validate:
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
                raise PromptError(f"token id out of range [0, {self.vocab_size})")
            if int(positions.max()) >= self.max_positions:
                raise PromptError(
                    f"position {int(positions.max())} exceeds the model's context of {self.max_positions} tokens"
                )
        with contextlib.nullcontext() if validate else unchecked():
            return self._forward(state, tokens, parents, positions, capture, leaky, keep_layer_outputs,
                                 recurrent_parents, visible, conv_parents)

    def _forward(self, state, tokens, parents, positions, capture, leaky, keep_layer_outputs,
                 recurrent_parents=None, visible=None, conv_parents=None) -> TreeForward:
        tree_ancestors = ancestor_matrix(parents)  # [n, n] ancestor-or-self: attention's mask and the GDN plan's
        visible = tree_ancestors if visible is None else visible
        rparents = parents if recurrent_parents is None else recurrent_parents.to(parents.device, torch.long)
        # leaky + chunk = the flattened tree as one chunk of a chain: what a leaking engine computes
        plan = TreePlan.build(rparents, leaky, need_levels=self.gdn_method == "levels",
                              ancestors=tree_ancestors if recurrent_parents is None else None)
        if conv_parents is not None:  # conv windows along other parents than the recurrence's
            cparents = conv_parents.to(parents.device, torch.long)
            plan.window_rows.update({k: conv_window_rows(cparents, k) for k in self.conv_kernels})
        for kernel in self.conv_kernels:  # index bookkeeping once per forward, outside any compiled layer
            plan.rows(kernel)
        n = tokens.shape[0]
        h = self._stage_input(tokens)  # [n, H]
        cos, sin = self.rope(h, positions)
        fwd = TreeForward(logits=torch.empty(0), context=torch.empty(0), visible=visible)
        held: dict[int, torch.Tensor] = {}
        for i in self._layer_ids():
            h, out = self.layer(i, h, state, plan, visible, cos, sin, leaky)
            if self.is_linear(i):
                fwd.conv[i], fwd.recurrent[i] = out.conv_windows, out.states
            else:
                fwd.keys[i], fwd.values[i] = out.keys, out.values
            if i in capture or keep_layer_outputs:
                held[i] = h
        fwd.logits = self._stage_logits(h)
        fwd.context = torch.cat([self._layer_output(i, held, n) for i in capture], dim=-1) if capture else h[:, :0]
        fwd.layer_outputs = [self._layer_output(i, held, n) for i in range(len(self.layers))] if keep_layer_outputs else None
        return fwd

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, R] of the rotary embedding at absolute ``positions`` [n] (h [n, H] for dtype/device)."""
        cos, sin = self.body.rotary_emb(h.unsqueeze(0), rope_position_ids(self.model_type, positions))
        return cos[0], sin[0]  # [n, R]

    def layer(self, i: int, h: torch.Tensor, state: TargetState, plan: TreePlan, visible: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, leaky: bool = False):
        """Decoder layer ``i`` over n nodes: h [n, H] in, (h after the layer [n, H], the mixer's output).

        The Gated DeltaNet mixer follows ``plan`` (its recurrence parents, ancestors and conv-window rows,
        which may differ: ``refcheck explain --layer`` builds such plans); attention follows ``visible``.
        The compiled layer (:meth:`compile`) runs only where nothing is checked on the host (a check would
        break its graph).
        """
        run = self._layer_fn if self.compiled and not checks_enabled() else decoder_layer
        if self.is_linear(i):
            mixer_state: tuple = (state.conv[i], state.recurrent[i])
        else:  # fixed-size caches (ddtree_reference/static.py) mask their unused slots
            mixer_state = (state.keys[i], state.values[i], getattr(state, "prefix_valid", None))
        return run(self.layers[i], self.is_linear(i), h, mixer_state, plan, visible, cos, sin, leaky,
                   self.gdn_method, self.residual_rounding, self.fusions[i])

    # -- the stages a layer-sharded target (ddtree_reference/sharded.py) replaces ------------------------------------
    def _stage_input(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(tokens)  # [n, H]

    def _layer_ids(self) -> range:
        return range(len(self.layers))

    def _stage_logits(self, h: torch.Tensor) -> torch.Tensor:
        # Logits in float32 so argmax, log-softmax and margins compare across model dtypes.
        return self.model.lm_head(self.body.norm(h)).float()  # [n, V]

    def _layer_output(self, layer: int, held: dict[int, torch.Tensor], n: int) -> torch.Tensor:
        return held[layer]

    def prefill(self, token_ids: torch.Tensor, capture: list[int] | tuple[int, ...] = (),
                chunk: int = PREFILL_CHUNK) -> tuple[TargetState, TreeForward]:
        """Run a prompt ([n] int64) as a chain from an empty state and commit all of it.

        The chain goes through in pieces of ``chunk`` tokens (bounded memory for the tree-chunk
        delta rule, like transformers' 64-token chunks); the returned forward holds the logits [n, V]
        and drafter context [n, len(capture)*H] of every prompt position.
        """
        n = int(token_ids.shape[0])
        if n == 0:
            raise PromptError("empty prompt")
        state = self.empty_state()
        logits, context = [], []
        for lo in range(0, n, chunk):
            piece = token_ids[lo : lo + chunk]
            m = int(piece.shape[0])
            fwd = self.forward(state, piece, torch.arange(-1, m - 1), torch.arange(m), capture=capture)
            state = state.commit(fwd, list(range(m)))
            logits.append(fwd.logits)
            context.append(fwd.context)
        return state, TreeForward(logits=torch.cat(logits), context=torch.cat(context))


def decoder_layer(layer: torch.nn.Module, linear: bool, h: torch.Tensor, mixer_state: tuple, plan: TreePlan,
                  visible: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, leaky: bool, gdn_method: str,
                  rounding: Callable[[torch.Tensor], torch.Tensor] | None,
                  fusion: LayerFusion = UNFUSED) -> tuple[torch.Tensor, Any]:
    """One transformers decoder layer over n nodes: h [n, H] -> (h [n, H], the token mixer's output).

    ``linear``: a Gated DeltaNet layer, ``mixer_state`` = (conv [K-1, C], recurrent [HV, Dk, Dv]); else
    attention, ``mixer_state`` = (past keys, past values [Hkv, P, D], valid past slots [P] or None).
    ``rounding`` (None: exact) is applied to the residual stream after each add (refcheck's rounding
    ensemble emulates an engine that stores the residual stream in its own dtype). ``fusion``: the
    layer's fused projection weights (ddtree_reference/fused.py). Tensors and plain values only, so that one
    compiled graph serves every layer of a kind (:meth:`Target.compile`).
    """
    x = layer.input_layernorm(h)
    if linear:
        conv, recurrent = mixer_state
        out = deltanet_tree(layer.linear_attn, x, plan.parents, conv, recurrent, leaky=leaky, method=gdn_method,
                            plan=plan, fused=fusion.mixer)
    else:
        keys, values, prefix_valid = mixer_state
        out = attention_tree(layer.self_attn, x, cos, sin, keys, values, visible, prefix_valid, fusion.mixer)
    h = h + out.hidden
    if rounding is not None:
        h = rounding(h)
    h = h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h), fusion.mlp)
    return (h if rounding is None else rounding(h)), out


def mlp_forward(mlp: torch.nn.Module, x: torch.Tensor, fused: torch.Tensor | None = None) -> torch.Tensor:
    """Dense or MoE MLP on [n, H]. A dense MLP with its gate | up ``fused`` weight (ddtree_reference/fused.py)
    runs them as one GEMM; otherwise the module's own forward (MoE blocks expect a batch axis and may
    return router logits)."""
    if fused is not None:
        gate, up = project(mlp, x, MLP, fused)  # [n, I] each
        return mlp.down_proj(mlp.act_fn(gate) * up)
    out = mlp(x.unsqueeze(0))
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(x.shape)
