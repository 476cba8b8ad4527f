"""Training of the built-in models: a tiny target on the generated corpus, then its DFlash drafter.

Contract: :func:`train_pair` trains, seeded, (1) the target (Qwen3.5 hybrid or Qwen3) as a causal LM
on the corpus, (2) distils the target's own greedy continuations of corpus prefixes, (3) trains a
DFlash drafter the DFlash way on them: a block ``[anchor, MASK × (B−1)]`` at positions
``a .. a+B−1`` attends non-causally to itself and to the context ``hidden_norm(fc(target hidden
states after target_layer_ids))`` at positions ``< a``, and predicts the target's continuation
``a+1 .. a+B−1`` with depth-decaying weights. :func:`draft_block_logits` is that batched forward; it
must equal :class:`ddtree_reference.drafter.DFlashDrafter` at inference (tests/test_train.py checks it).
Checkpoints are written in the layouts the reference, z-lab's ``dflash`` and SGLang load.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from refcheck.models.build import INIT_STD, draft_config, draft_state, save_draft, save_target
from refcheck.models.corpus import corpus_sha256, generate_corpus


@dataclass(slots=True)
class TrainConfig:
    seed: int = 0
    seq_len: int = 128
    target_steps: int = 1500
    target_batch: int = 64
    target_lr: float = 3e-3
    distill_prompts: int = 4096
    distill_prefix: tuple[int, int] = (8, 48)  # prefix length range (tokens)
    distill_new: int = 80
    draft_steps: int = 3000
    draft_batch: int = 64
    draft_anchors: int = 4
    draft_lr: float = 3e-3
    depth_decay: float = 7.0  # loss weight of depth d: exp(-(d-1)/depth_decay)

    @classmethod
    def for_pair(cls, name: str, seed: int = 0) -> TrainConfig:
        """The pair's training settings: the tiny pairs' defaults; the wide pair at a learning rate for
        1024-wide layers and fewer steps (minutes on one H200)."""
        return cls(seed=seed, **PAIR_TRAINING.get(name, {}))


#: per-pair overrides of :class:`TrainConfig`
#: (the wide pair: transformers' Gated DeltaNet without its fused kernels is launch-bound, ~0.4 s a step at
#: batch 64 on an H200 whatever the batch, so it trains on fewer, larger batches; its loss is at the tiny
#: pair's 0.89 by 64 k sequences at batch 64)
PAIR_TRAINING: dict[str, dict] = {"wide": dict(target_steps=300, target_batch=128, target_lr=2e-3, distill_prompts=1024,
                                               distill_new=48, draft_steps=400, draft_batch=128, draft_lr=1e-3)}


def corpus_tokens(tokenizer, seed: int) -> torch.Tensor:
    """The corpus as one token stream, documents separated by <|endoftext|> (id 0): [n] int64."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for _, text in generate_corpus(seed):
        ids += tokenizer.encode(text).ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


def _batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device: str):
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
    return stream[idx].to(device)


def _cosine(step: int, total: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def _step(opt: torch.optim.Optimizer, params, loss: torch.Tensor, lr: float) -> float:
    """One optimiser step at learning rate lr with gradient clipping at 1.0; returns the loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach())


def train_target(model: torch.nn.Module, stream: torch.Tensor, cfg: TrainConfig, device: str, log) -> float:
    model.train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    loss_v = float("nan")
    for step in range(cfg.target_steps):
        xy = _batches(stream, cfg.target_batch, cfg.seq_len, gen, device)
        logits = model(input_ids=xy[:, :-1]).logits  # [B, T, V]
        # float32 loss: bf16 log-softmax over the vocabulary loses the small probabilities
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), xy[:, 1:].reshape(-1))
        loss_v = _step(opt, model.parameters(), loss, cfg.target_lr * _cosine(step, cfg.target_steps))
        if step % 250 == 0 or step == cfg.target_steps - 1:
            log(f"target step {step} loss {loss_v:.4f}")
    return loss_v


@torch.no_grad()
def distill(model: torch.nn.Module, stream: torch.Tensor, cfg: TrainConfig, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Target greedy continuations of random corpus prefixes: sequences [N, P+new] and prefix lengths [N]."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    lo, hi = cfg.distill_prefix
    seqs, plens = [], []
    per = 512
    for b in range(0, cfg.distill_prompts, per):
        n = min(per, cfg.distill_prompts - b)
        plen = int(torch.randint(lo, hi + 1, (), generator=gen))
        x = _batches(stream, n, plen - 1, gen, device)  # [n, plen]
        for _ in range(cfg.distill_new):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], dim=1)
        seqs.append(x.cpu())
        plens += [plen] * n
    width = max(s.shape[1] for s in seqs)
    out = torch.zeros(len(plens), width, dtype=torch.long)
    lens = torch.tensor(plens)
    row = 0
    for s in seqs:  # right-align is not needed: each group has one prefix length; pad on the right
        out[row : row + s.shape[0], : s.shape[1]] = s
        row += s.shape[0]
    return out, lens


class DraftNet(torch.nn.Module):
    """The DFlash draft weights as trainable parameters, named exactly like the z-lab checkpoint."""

    def __init__(self, init: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(init)
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone()) for k, v in init.items()})

    def state(self) -> dict[str, torch.Tensor]:
        return {k: self.params[k.replace(".", "__")] for k in self.names}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3 RMSNorm (weight * normalised x, computed in float32 like transformers)."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Full-width RoPE on x [B, H, T, D] at positions pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = pos[..., None].float() * inv  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def draft_block_logits(
    w: dict[str, torch.Tensor],
    dcfg: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    ctx_feats: torch.Tensor,
    ctx_valid: torch.Tensor,
    block_ids: torch.Tensor,
    block_pos: torch.Tensor,
) -> torch.Tensor:
    """Batched DFlash forward.

    ctx_feats [B, C, nL*H] (target hidden states at positions 0..C-1), ctx_valid [B, C] bool (context
    position < anchor), block_ids [B, bs] ([anchor, MASK...]), block_pos [B, bs] positions.
    Returns logits [B, bs-1, V] for block positions 1..bs-1.
    """
    bsz, bs = block_ids.shape
    c = ctx_feats.shape[1]
    nh, nkv, hd = dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]
    theta = dcfg.get("rope_theta", 10000.0)
    ctx = _rms(ctx_feats @ w["fc.weight"].T, w["hidden_norm.weight"])  # [B, C, H]
    h = F.embedding(block_ids, embed)  # [B, bs, H]
    ctx_pos = torch.arange(c, device=h.device).expand(bsz, c)
    mask = torch.cat([ctx_valid, torch.ones(bsz, bs, dtype=torch.bool, device=h.device)], dim=1)  # [B, C+bs]
    for n in range(dcfg["num_hidden_layers"]):
        p = f"layers.{n}."
        x = _rms(h, w[p + "input_layernorm.weight"])
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(bsz, bs, nh, hd), w[p + "self_attn.q_norm.weight"])
        kb = _rms((x @ w[p + "self_attn.k_proj.weight"].T).view(bsz, bs, nkv, hd), w[p + "self_attn.k_norm.weight"])
        vb = (x @ w[p + "self_attn.v_proj.weight"].T).view(bsz, bs, nkv, hd)
        kc = _rms((ctx @ w[p + "self_attn.k_proj.weight"].T).view(bsz, c, nkv, hd), w[p + "self_attn.k_norm.weight"])
        vc = (ctx @ w[p + "self_attn.v_proj.weight"].T).view(bsz, c, nkv, hd)
        q = _rope(q.transpose(1, 2), block_pos, theta)  # [B, nh, bs, hd]
        k = torch.cat([_rope(kc.transpose(1, 2), ctx_pos, theta), _rope(kb.transpose(1, 2), block_pos, theta)], dim=2)
        v = torch.cat([vc.transpose(1, 2), vb.transpose(1, 2)], dim=2)  # [B, nkv, C+bs, hd]
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=hd**-0.5)
        h = h + att.transpose(1, 2).reshape(bsz, bs, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
    h = _rms(h, w["norm.weight"])
    return (h[:, 1:] @ lm_head.T).float()  # float32 logits for the loss


def context_features(model: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Target hidden states after each of layer_ids, concatenated: [B, T, len*H] (HF index i+1)."""
    out = model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def train_drafter(model: torch.nn.Module, seqs: torch.Tensor, plens: torch.Tensor, dcfg: dict, cfg: TrainConfig,
                  device: str, log) -> tuple[dict[str, torch.Tensor], float, list[float]]:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    net = DraftNet(draft_state(dcfg, cfg.seed + 2, dcfg.get("initializer_range", INIT_STD))).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    layer_ids = dcfg["dflash_config"]["target_layer_ids"]
    mask_id = dcfg["dflash_config"]["mask_token_id"]
    bs = dcfg["dflash_config"]["block_size"]
    weights = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / cfg.depth_decay).to(device)
    loss_v, acc = float("nan"), [0.0] * (bs - 1)
    for step in range(cfg.draft_steps):
        rows = torch.randint(0, seqs.shape[0], (cfg.draft_batch,), generator=gen)
        s, pl = seqs[rows].to(device), plens[rows].to(device)  # [b, T], [b]
        t = s.shape[1]
        with torch.no_grad():
            feats = context_features(model, s, layer_ids)  # [b, T, nL*H]
        # anchors in the target-generated part, leaving room for a full block of labels
        span = (t - bs) - pl  # [b]
        a = pl[:, None] + (torch.rand(len(rows), cfg.draft_anchors, generator=gen).to(device) * (span[:, None] + 1)).long()
        a = a.reshape(-1)  # [b*M]
        src = torch.arange(len(rows), device=device).repeat_interleave(cfg.draft_anchors)
        offs = torch.arange(bs, device=device)
        pos = a[:, None] + offs  # [b*M, bs]
        blk = torch.full_like(pos, mask_id)
        blk[:, 0] = s[src, a]
        labels = s[src[:, None], pos[:, 1:]]  # [b*M, bs-1]
        valid = torch.arange(t, device=device)[None] < a[:, None]  # [b*M, T]
        logits = draft_block_logits(net.state(), dcfg, embed, lm_head, feats[src], valid, blk, pos)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(labels)
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        loss_v = _step(opt, net.parameters(), loss, cfg.draft_lr * _cosine(step, cfg.draft_steps))
        if step % 250 == 0 or step == cfg.draft_steps - 1:
            acc = (logits.argmax(-1) == labels).float().mean(0).tolist()
            log(f"draft step {step} loss {loss_v:.4f} acc@1 {acc[0]:.3f} acc@4 {acc[3]:.3f} acc@15 {acc[-1]:.3f}")
    return {k: v.detach().cpu() for k, v in net.state().items()}, loss_v, acc


def train_pair(name: str, out_dir: Path, tokenizer_path: Path, cfg: TrainConfig, device: str, log=print) -> dict:
    from tokenizers import Tokenizer

    from refcheck.models.build import build_target

    torch.manual_seed(cfg.seed)
    tok = Tokenizer.from_file(str(tokenizer_path))
    t0 = time.time()
    stream = corpus_tokens(tok, cfg.seed)
    model = build_target(name, cfg.seed)
    t_corpus = time.time() - t0
    target_loss = train_target(model, stream, cfg, device, log)
    t_target = time.time() - t0 - t_corpus
    seqs, plens = distill(model, stream, cfg, device)
    t_distill = time.time() - t0 - t_corpus - t_target
    dcfg = draft_config(model.config.num_hidden_layers, name)
    draft_w, draft_loss, draft_acc = train_drafter(model, seqs, plens, dcfg, cfg, device, log)
    t_draft = time.time() - t0 - t_corpus - t_target - t_distill
    info = {
        "pair": name, "device": device, "config": asdict(cfg), "corpus_sha256": corpus_sha256(generate_corpus(cfg.seed)),
        "corpus_tokens": int(stream.numel()), "final_target_loss": target_loss, "final_draft_loss": draft_loss,
        "draft_train_acc_per_depth": draft_acc,
        "wall_s": {"corpus": t_corpus, "target": t_target, "distill": t_distill, "draft": t_draft},
        "torch": torch.__version__,
    }
    save_target(model.cpu().eval(), Path(out_dir) / "target", tokenizer_path, info)
    save_draft(Path(out_dir) / "draft", dcfg, draft_w)
    (Path(out_dir) / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
