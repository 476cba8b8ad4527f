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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 512  # the built-in byte-level BPE tokenizer (scripts/make_tokenizer.py)
EOS_TOKEN_ID = 0  # <|endoftext|>: document separator and stop token
MASK_TOKEN_ID = 1  # <|mask|>: the drafter's MASK input, never in prompts
HIDDEN = 128
INIT_STD = 0.1  # larger than the usual 0.02 so that random logits have usable margins

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
    "wide": dict(
        model_type="qwen3_5_text",
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
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
}


def widths(name: str) -> dict:
    """COMMON's width fields with the pair's overrides: hidden, intermediate, heads, head_dim, initializer."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "initializer_range")
    return {k: WIDTHS.get(name, {}).get(k, COMMON[k]) for k in keys}


def _save(model_dir: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # bfloat16 halves the repository size; loading upcasts exactly.
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def build_target(name: str, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TARGET_CONFIGS[name])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **(COMMON | widths(name)), **spec)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def draft_config(target_layers: int, pair: str = "hybrid") -> dict:
    from reference.drafter import default_target_layer_ids

    w = widths(pair)
    return dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=w["hidden_size"],
        intermediate_size=w["intermediate_size"],
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=w["num_attention_heads"],
        num_key_value_heads=w["num_key_value_heads"],
        head_dim=w["head_dim"],
        initializer_range=w["initializer_range"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        attention_bias=False,
        tie_word_embeddings=True,
        layer_types=["full_attention"] * DRAFT_LAYERS,
        num_target_layers=target_layers,
        block_size=BLOCK_SIZE,
        dflash_config=dict(
            mask_token_id=MASK_TOKEN_ID,
            target_layer_ids=default_target_layer_ids(target_layers, DRAFT_LAYERS),
            block_size=BLOCK_SIZE,
            num_target_layers=target_layers,
        ),
    )


def draft_state(cfg: dict, seed: int, init_std: float = INIT_STD) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=gen) * init_std

    state: dict[str, torch.Tensor] = {}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        state |= {
            p + "self_attn.q_proj.weight": w(nq * d, h),
            p + "self_attn.k_proj.weight": w(nkv * d, h),
            p + "self_attn.v_proj.weight": w(nkv * d, h),
            p + "self_attn.o_proj.weight": w(h, nq * d),
            p + "self_attn.q_norm.weight": torch.ones(d),
            p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    state |= {"fc.weight": w(h, n_ctx * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
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
