"""Checks on models and run settings made before any decoding, each a typed error.

Contract:

* :func:`check_device`: ``cpu``, ``cuda`` or ``cuda:N`` (and CUDA present for the latter two),
  else :class:`~refcheck.errors.UsageError` (exit 2).
* :func:`check_safetensors`: every ``*.safetensors`` file of a checkpoint directory has a readable
  header, else :class:`~ddtree_reference.errors.CheckpointError` (exit 6) naming the file.
* :func:`check_finite_weights`: no NaN or Inf in a loaded model's parameters and buffers, else
  :class:`~refcheck.errors.NonFiniteError` (exit 6) naming the model, the tensor and the count.
* :func:`check_draft_for_target`: a DFlash draft's ``num_target_layers`` (top level or in
  ``dflash_config``) equals the target's layer count, its ``target_layer_ids`` lie inside it, and
  its hidden and vocabulary sizes match, else :class:`~ddtree_reference.errors.ModelMismatchError` (exit 6).
* :func:`check_budget`: a node budget fits the target's context (``budget + 1`` tree nodes after at
  least one committed token) and the estimated memory of the tree (:func:`tree_memory_bytes`) fits
  the device's available memory, else :class:`~refcheck.errors.UsageError` (exit 2) with the
  numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_reference.errors import CheckpointError, ModelMismatchError
from refcheck.errors import NonFiniteError, UsageError

MEMORY_FRACTION = 0.8  # of the available memory a tree may take


def check_device(device: str) -> None:
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise UsageError(f"unknown device {device!r} (choose cpu, cuda or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} requested but no CUDA device is available")


def check_safetensors(directory: Path, what: str) -> None:
    from safetensors import safe_open

    for f in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{what} weights {f} are not a valid safetensors file: "
                                  f"{str(exc).splitlines()[0][:200]}") from None


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            nan = int(torch.isnan(t).sum())
            raise NonFiniteError(f"{what}: tensor {name} holds {nan} NaN and {int((~finite).sum()) - nan} Inf values "
                                 f"(of {t.numel()}); the checkpoint is broken")


def _draft_config(draft_dir: Path) -> dict:
    try:
        cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # the drafter's loader reports a missing or malformed config itself
    return cfg if isinstance(cfg, dict) else {}


def check_draft_for_target(draft_dir: Path, n_layers: int, hidden_size: int, vocab_size: int) -> None:
    cfg = _draft_config(draft_dir)
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    made_for = dcfg.get("num_target_layers", cfg.get("num_target_layers"))
    if made_for is not None and made_for != n_layers:
        raise ModelMismatchError(f"draft {draft_dir} was made for a {made_for}-layer target; this target has {n_layers} "
                                 "layers")
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids")) or []
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise ModelMismatchError(f"draft {draft_dir}: target_layer_ids {bad} outside the target's {n_layers} layers")
    for key, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if key in cfg and cfg[key] != want:
            label = key.replace("_", " ")
            raise ModelMismatchError(f"draft {label} {cfg[key]} != target {label} {want} (draft {draft_dir})")


def tree_memory_bytes(budget: int, hidden_size: int, vocab_size: int, n_layers: int, context: int,
                      element_bytes: int) -> int:
    """Estimated peak bytes of one tree verify of ``budget + 1`` nodes: the ancestor matrix (bool)
    and the additive attention mask over context + tree, one layer's per-node activations (about 16
    hidden-size rows per node), the tree's K and V rows in every layer, and the log-softmax over
    the vocabulary (3 copies). An estimate for refusing hopeless budgets, not an allocator."""
    n = budget + 1
    masks = n * n * (1 + element_bytes) + n * (context + n) * element_bytes
    activations = n * hidden_size * (16 + 2 * max(n_layers, 1)) * element_bytes
    logits = n * vocab_size * element_bytes * 3
    return masks + activations + logits


def available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: no memory bound (the context bound still applies)


def check_budget(budget: int | None, max_positions: int, hidden_size: int, vocab_size: int, n_layers: int,
                 element_bytes: int, device: str, available: int | None = None) -> None:
    if budget is None:
        return
    if budget + 2 > max_positions:
        raise UsageError(f"--budget {budget}: a tree of {budget + 1} nodes after the prompt does not fit the target's "
                         f"context of {max_positions} positions (at most --budget {max_positions - 2})")
    need = tree_memory_bytes(budget, hidden_size, vocab_size, n_layers, max_positions, element_bytes)
    have = available_bytes(device) if available is None else available
    if need > MEMORY_FRACTION * have:
        raise UsageError(f"--budget {budget}: one tree verify needs about {need / 2**30:.2f} GiB on {device}, more than "
                         f"{MEMORY_FRACTION:.0%} of the {have / 2**30:.2f} GiB available; lower the budget")
