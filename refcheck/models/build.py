"""Architecture and checkpoint layout of the built-in tiny models.

Contract: ``build_target(name, seed)`` makes an untrained target (Qwen3.5 hybrid or Qwen3);
``draft_config`` / ``draft_state`` the DFlash drafter's config and initial weights;
``save_target`` / ``save_draft`` write checkpoints that load in the reference, in z-lab's ``dflash``
and in SGLang (extra config fields SGLang needs: ``full_attention_interval``, top-level
``rope_theta`` / ``partial_rotary_factor``; the drafter's ``layer_types`` and
``dflash_config.num_target_layers``). ``build_pair(name, out_dir, seed)`` writes a random-weight pair
(used by tests and as the fallback); the shipped built-ins are trained (``refcheck.models.train``).
Weights are stored in bfloat16 to keep the repository small; the reference loads them in any dtype
(bf16 -> fp32 is exact).

The ``real`` pair (not shipped; :func:`build_real_pair`, ``scripts/real_width.py build``) has
Qwen3.6-27B's widths (hidden 5120, 24 x 256 attention heads over 4 KV heads, Gated DeltaNet 16 key /
48 value heads of 128, intermediate 17408, vocab 248320 untied) and fewer layers (8 by default, any
multiple of 4 at the 3 Gated DeltaNet : 1 attention pattern; 64 is the full shape), with a DFlash
draft of z-lab's Qwen3.6-27B-DFlash shape (5 layers, 32 x 128 heads over 8 KV heads, the default
spread of target layers; all full attention, where z-lab's has 2048-token sliding windows in four
layers, the same attention at the contexts refcheck runs). Its weights are random, built directly on
the device in bfloat16, each tensor from its own generator seeded by (seed, tensor name): the same
seed, device type and torch give the same bytes, and a deeper build's first layers equal a shallower
one's. Initializer std 0.02: with the final norm at 1, logits have std sqrt(5120) * 0.02 = 1.4 nats,
so the top-1/top-2 gaps (~0.3 nats on average over 248 320 tokens) are not all bf16 ties, though the
distributions are close to uniform. Checkpoints are written in shards of at most 5 GiB
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, transformers' layout, which
SGLang and the reference read); a pair that fits one shard gets ``model.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from refcheck.errors import UsageError

VOCAB = 512  # the built-in byte-level BPE tokenizer (scripts/make_tokenizer.py)
EOS_TOKEN_ID = 0  # <|endoftext|>: document separator and stop token
MASK_TOKEN_ID = 1  # <|mask|>: the drafter's MASK input, never in prompts
HIDDEN = 128
INIT_STD = 0.1  # larger than the usual 0.02 so that random logits have usable margins


def _three_to_one(layers: int, key_heads: int, value_heads: int, head_dim: int) -> dict:
    """A qwen3_5_text layer plan at Qwen3.6's pattern, 3 Gated DeltaNet layers : 1 full attention."""
    return dict(model_type="qwen3_5_text", num_hidden_layers=layers,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=head_dim,
                linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)


TARGET_CONFIGS: dict[str, dict] = {
    "hybrid": dict(
        model_type="qwen3_5_text",
        num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    ),
    "attention": dict(model_type="qwen3", num_hidden_layers=4),
    # the calibration corpus's wider hybrid (not shipped: 109 M parameters; built and trained on the GPU
    # from its seed by scripts/train_builtin.py --pairs wide): hidden 1024, 8 layers at 3 Gated DeltaNet
    # : 1 full attention, as Qwen3.6's layer pattern
    "wide": _three_to_one(8, key_heads=4, value_heads=8, head_dim=128),
    # Qwen3.6-27B's widths (WIDTHS["real"]) at 8 of its 64 layers (not shipped; built on the GPU by
    # scripts/real_width.py); real_configs() takes any multiple of 4 layers
    "real": _three_to_one(8, key_heads=16, value_heads=48, head_dim=128),
}
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=192,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=INIT_STD,
    bos_token_id=None,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=None,
)
DRAFT_LAYERS = 2
BLOCK_SIZE = 16
#: per-pair widths over COMMON, shared by the target and its drafter (the tiny pairs use COMMON's)
WIDTHS: dict[str, dict] = {
    "hybrid": {}, "attention": {},
    # initializer 0.02: COMMON's 0.1 (chosen for random tiny logits) is too large for 1024-wide layers
    "wide": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 initializer_range=0.02),
    # Qwen3.6-27B's (scripts/bench_verify.py SHAPES["qwen3.6-27b"]); untied embeddings and LM head, as Qwen3.6
    "real": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                 initializer_range=0.02, vocab_size=248320, tie_word_embeddings=False),
}
#: per-pair drafter shapes where they are not the target's widths with DRAFT_LAYERS layers: the real pair's is
#: z-lab's Qwen3.6-27B-DFlash (5 layers; 32 query heads of 128 over 8 KV heads; the target's hidden and MLP widths)
DRAFT_SHAPES: dict[str, dict] = {
    "real": dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
#: the real pair's Gated DeltaNet head fields (TARGET_CONFIGS["real"]), which real_configs() overrides may scale
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
#: a test-only scale of the real pair (tests/test_real_width.py; ``scripts/real_width.py build --tiny``): the same
#: code path and layout at hidden 64, vocab 1000 (initializer 0.1, as the tiny pairs, for usable random margins)
REAL_TINY: dict = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       vocab_size=1000, initializer_range=0.1,
                       draft=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
SHARD_BYTES = 5 << 30  # the largest checkpoint shard written (transformers' customary 5 GB)


def widths(name: str) -> dict:
    """COMMON's width fields with the pair's overrides: hidden, intermediate, heads, head_dim, initializer,
    vocabulary and whether the LM head is tied to the embeddings."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "initializer_range", "vocab_size", "tie_word_embeddings")
    return {k: WIDTHS.get(name, {}).get(k, COMMON[k]) for k in keys}


def _write_config(model_dir: Path, config: dict) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shards(state: dict[str, torch.Tensor], shard_bytes: int | None) -> list[list[str]]:
    """The tensor names of each shard, in state order, each shard at most ``shard_bytes`` of bf16 (or one
    tensor); None: one shard."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * 2  # stored as bfloat16
        if shard_bytes is not None and groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def _write_weights(model_dir: Path, state: dict[str, torch.Tensor], shard_bytes: int | None = None) -> list[Path]:
    """``model.safetensors``, or shards + ``model.safetensors.index.json`` (transformers' layout) when the
    state is larger than ``shard_bytes``; returns the files written."""
    groups = _shards(state, shard_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, group in zip(names, groups):
        # bfloat16 halves the repository size; loading upcasts exactly. One shard at a time on the host
        # (safetensors writes host memory), so a GPU-built model never sits twice in host memory.
        weights = {k: state[k].detach().to(device="cpu", dtype=torch.bfloat16).contiguous() for k in group}
        save_file(weights, str(model_dir / name), metadata={"format": "pt"})
        del weights
    if n > 1:
        index = {"metadata": {"total_size": sum(v.numel() * 2 for v in state.values())},
                 "weight_map": {k: name for name, group in zip(names, groups) for k in group}}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [model_dir / name for name in names]


def _save(model_dir: Path, config: dict, state: dict[str, torch.Tensor], shard_bytes: int | None = None) -> None:
    _write_config(model_dir, config)
    _write_weights(model_dir, state, shard_bytes)


def _target_fields(name: str) -> tuple[str, dict]:
    """A pair's target model type and its config fields (COMMON, the pair's widths, its layer spec)."""
    spec = dict(TARGET_CONFIGS[name])
    model_type = spec.pop("model_type")
    return model_type, {**COMMON, **widths(name), **spec}


def build_target(name: str, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TARGET_CONFIGS[name])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **(COMMON | widths(name)), **spec)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _draft_dict(target_layers: int, w: dict, shape: dict) -> dict:
    """A DFlash draft config over widths ``w`` (widths()); ``shape`` overrides its layer count and heads."""
    from ddtree_reference.drafter import default_target_layer_ids

    layers = shape.get("num_hidden_layers", DRAFT_LAYERS)
    return dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=w["vocab_size"],
        hidden_size=w["hidden_size"],
        intermediate_size=w["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=shape.get("num_attention_heads", w["num_attention_heads"]),
        num_key_value_heads=shape.get("num_key_value_heads", w["num_key_value_heads"]),
        head_dim=shape.get("head_dim", w["head_dim"]),
        initializer_range=w["initializer_range"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        attention_bias=False,
        tie_word_embeddings=w["tie_word_embeddings"],
        layer_types=["full_attention"] * layers,
        num_target_layers=target_layers,
        block_size=BLOCK_SIZE,
        dflash_config=dict(
            mask_token_id=MASK_TOKEN_ID,
            target_layer_ids=default_target_layer_ids(target_layers, layers),
            block_size=BLOCK_SIZE,
            num_target_layers=target_layers,
        ),
    )


def draft_config(target_layers: int, pair: str = "hybrid") -> dict:
    return _draft_dict(target_layers, widths(pair), DRAFT_SHAPES.get(pair, {}))


def draft_state(cfg: dict, seed: int, init_std: float = INIT_STD, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random draft weights (float32) from one generator seeded by ``seed``, drawn on ``device`` (the CPU's
    stream for the built-ins; a GPU's for the real pair, whose drafter is 1.7 B parameters)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=gen, device=device) * init_std

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device)

    state: dict[str, torch.Tensor] = {}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        state |= {
            p + "self_attn.q_proj.weight": w(nq * d, h),
            p + "self_attn.k_proj.weight": w(nkv * d, h),
            p + "self_attn.v_proj.weight": w(nkv * d, h),
            p + "self_attn.o_proj.weight": w(h, nq * d),
            p + "self_attn.q_norm.weight": ones(d),
            p + "self_attn.k_norm.weight": ones(d),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    state |= {"fc.weight": w(h, n_ctx * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    return state


def _sglang_fields(cfg: dict) -> dict:
    """Config fields SGLang reads that transformers drops on save (see shared sglang-gpu notes)."""
    if cfg.get("model_type") in ("qwen3_5_text", "qwen3_5"):
        cfg["full_attention_interval"] = cfg["layer_types"].index("full_attention") + 1
        rope = cfg.get("rope_parameters") or {}
        cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
        cfg["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25)
    return cfg


def save_target(model: torch.nn.Module, tdir: Path, tokenizer_path: Path | None = None, info: dict | None = None) -> None:
    from safetensors.torch import load_file

    tdir = Path(tdir)
    model.save_pretrained(str(tdir))
    state = load_file(str(tdir / "model.safetensors"))
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    if info:
        cfg["refcheck_training"] = {k: info[k] for k in ("corpus_sha256", "final_target_loss") if k in info}
    for extra in tdir.glob("*"):
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    _save(tdir, _sglang_fields(cfg), state)
    if tokenizer_path is not None:
        (tdir / "tokenizer.json").write_bytes(Path(tokenizer_path).read_bytes())


def save_draft(ddir: Path, dcfg: dict, weights: dict[str, torch.Tensor]) -> None:
    _save(Path(ddir), dcfg, weights)


def build_pair(name: str, out_dir: Path, seed: int = 0) -> None:
    """A random-weight pair (tests, and the fallback before training)."""
    target = build_target(name, seed)
    save_target(target, Path(out_dir) / "target")
    dcfg = draft_config(target.config.num_hidden_layers, name)
    save_draft(Path(out_dir) / "draft", dcfg, draft_state(dcfg, seed + 1, widths(name)["initializer_range"]))


# ------------------------------------------------------------------ the real-width pair (built on the GPU)
def real_configs(layers: int = 8, overrides: dict | None = None) -> tuple[dict, dict]:
    """The real pair's target config fields (``model_type`` included) and its draft config, for ``layers``
    target layers (a positive multiple of 4: 3 Gated DeltaNet + 1 full attention each). ``overrides``
    (test-only scales such as :data:`REAL_TINY`) replace width and Gated DeltaNet head fields; its ``draft``
    entry replaces fields of the drafter's shape."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 4 or layers % 4:
        raise UsageError(f"the real pair's layers come in groups of 3 Gated DeltaNet + 1 full attention: layers must "
                         f"be a positive multiple of 4 (64 is Qwen3.6-27B's), got {layers!r}")
    over = dict(overrides or {})
    shape = DRAFT_SHAPES["real"] | over.pop("draft", {})
    unknown = sorted(set(over) - set(widths("real")) - set(LINEAR_FIELDS))
    unknown += sorted(f"draft.{k}" for k in set(shape) - set(DRAFT_SHAPES["real"]))
    if unknown:
        raise UsageError(f"unknown real-pair override(s): {', '.join(unknown)}")
    model_type, fields = _target_fields("real")
    fields |= over
    fields.update(num_hidden_layers=layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    w = {k: fields[k] for k in widths("real")}
    return {"model_type": model_type, **fields}, _draft_dict(layers, w, shape)


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor: independent of the order tensors are made in."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every random parameter from its own generator on its device, seeded by (seed, name):
    matrices, embeddings and conv kernels ~ N(0, std); Gated DeltaNet ``A_log`` = log U(0.01, 16) (transformers'
    initialisation). The constant ones (norms, ``dt_bias``) keep transformers' values."""
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(_tensor_seed(seed, name))
        if name.endswith("A_log"):
            # drawn and logged in float32, rounded once into the parameter's dtype (bf16: a log of a bf16 draw
            # would round twice)
            p.copy_(torch.empty(p.shape, dtype=torch.float32, device=p.device).uniform_(0.01, 16, generator=gen).log_())
        elif p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)


def build_real_target(fields: dict, seed: int, device: str | torch.device = "cuda") -> torch.nn.Module:
    """The real pair's target (fields from :func:`real_configs`), its parameters created in bfloat16 directly
    on ``device`` and filled by :func:`fill_random`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    prev = torch.get_default_dtype()
    # bf16 from the start: an 8-layer model is 11 GB in bf16, twice that in fp32, and never needs fp32 here
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    fill_random(model, seed, cfg.initializer_range)
    return model.eval()


def save_target_sharded(model: torch.nn.Module, tdir: Path, shard_bytes: int | None = SHARD_BYTES) -> list[Path]:
    """A target checkpoint written from wherever its weights are: ``config.json`` as transformers'
    ``save_pretrained`` writes it plus what :func:`save_target` adds (dtype, SGLang's fields), the weights in
    shards (:func:`_write_weights`; the tied LM head left out, as transformers does). Returns the weight files."""
    tdir = Path(tdir)
    tdir.mkdir(parents=True, exist_ok=True)
    config: Any = model.config  # a transformers config (typed by transformers only dynamically)
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(tdir))
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    _write_config(tdir, _sglang_fields(cfg))
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return _write_weights(tdir, state, shard_bytes)


def _sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def build_real_pair(out_dir: Path, layers: int = 8, seed: int = 0, device: str | torch.device = "cuda",
                    overrides: dict | None = None, shard_bytes: int | None = SHARD_BYTES) -> dict:
    """Write OUT/target and OUT/draft of the real pair (:func:`real_configs`), random weights built on
    ``device``; the draft's seed is ``seed + 1`` (as :func:`build_pair`). Returns parameter counts, bytes on
    disk and wall seconds per phase."""
    out_dir = Path(out_dir)
    fields, dcfg = real_configs(layers, overrides)
    t0 = time.perf_counter()
    target = build_real_target(fields, seed, device)
    _sync(device)
    t1 = time.perf_counter()
    save_target_sharded(target, out_dir / "target", shard_bytes)
    n_target = sum(p.numel() for p in target.parameters())
    del target
    t2 = time.perf_counter()
    dstate = draft_state(dcfg, seed + 1, dcfg["initializer_range"], device)
    _sync(device)
    t3 = time.perf_counter()
    _save(out_dir / "draft", dcfg, dstate, shard_bytes)
    n_draft = sum(v.numel() for v in dstate.values())
    del dstate
    t4 = time.perf_counter()
    return {"pair": "real", "layers": layers, "seed": seed, "device": str(device), "overrides": overrides or None,
            "target_parameters": n_target, "draft_parameters": n_draft,
            "target_bytes": _dir_bytes(out_dir / "target"), "draft_bytes": _dir_bytes(out_dir / "draft"),
            "wall_s": {"target_build": round(t1 - t0, 3), "target_save": round(t2 - t1, 3),
                       "draft_build": round(t3 - t2, 3), "draft_save": round(t4 - t3, 3), "total": round(t4 - t0, 3)},
            "torch": torch.__version__}
