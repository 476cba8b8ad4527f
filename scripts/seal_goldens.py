"""Seal a golden directory's schema 1.0 traces as schema 1.1 (their own checksums), proving each
one's decoded content unchanged.

Contract: for every manifest case whose trace has no checksums, the trace is decoded, re-encoded
by this refcheck (schema 1.1, sealed), decoded again, and the two decodings are compared through
:func:`content_sha256` (every provenance key, request and step field; floats by value with NaN
kept; tensors by dtype, shape and raw bytes). Only when they are equal is the new file written,
all cases in one golden store transaction (``refcheck.goldens.store.commit``), each with a history
entry whose reason carries the content digest. Any difference aborts with nothing written
(exit 1). Already sealed cases are skipped, so a second run changes nothing.

    python scripts/seal_goldens.py [GOLDEN_DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from refcheck.goldens import default_golden_dir, load_manifest, store
from refcheck.trace.io import Trace, trace_bytes, trace_from_bytes

REASON = "sealed as trace schema 1.1 (the file's own checksums, issue 19); decoded content identical to the 1.0 file"


def _plain(x: Any) -> Any:
    """JSON-able with floats exact (repr) and NaN/inf spelled out."""
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else str(x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def _tensor(t: torch.Tensor | None) -> Any:
    if t is None:
        return None
    t = t.contiguous()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return [str(t.dtype), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]


def content_sha256(trace: Trace) -> str:
    """sha256 of a decoded trace's content (independent of its bytes and schema version)."""
    h = hashlib.sha256()
    h.update(json.dumps(_plain(trace.provenance), sort_keys=True).encode())
    for r in trace.requests:
        h.update(json.dumps(_plain([r.request_id, r.kind, r.prompt_ids, r.output_ids, r.output_logprobs])).encode())
    for s in trace.steps:
        fields = [s.request_id, s.step, s.committed_len, s.tree_tokens, s.tree_parents, s.tree_depths, s.tree_ranks,
                  s.draft_topk_ids, s.draft_topk_logprobs, s.topk_ids, s.topk_logprobs, s.target_argmax, s.accepted,
                  s.accept_length, s.bonus, s.emitted, s.emitted_logprobs, s.timings]
        state = [[e.name, e.layer, e.kind, _tensor(e.sketch), _tensor(e.full)] for e in s.state]
        h.update(json.dumps(_plain(fields + [state, _tensor(s.layer_sketch)]), sort_keys=True).encode())
    return h.hexdigest()


def seal(golden_dir: Path, dry_run: bool = False) -> list[tuple[str, str, int, int]]:
    """Seal every unsealed case; returns (case, content sha256, old bytes, new bytes) per case sealed."""
    manifest = load_manifest(golden_dir)
    writes, done = [], []
    for case, entry in sorted(manifest.cases.items()):
        old_bytes = (golden_dir / entry.file).read_bytes()
        old = trace_from_bytes(old_bytes, entry.file)
        if old.checksummed:
            continue
        new_bytes = trace_bytes(old)
        new = trace_from_bytes(new_bytes, f"{entry.file} (sealed)")
        before, after = content_sha256(old), content_sha256(new)
        if before != after or not new.checksummed:
            sys.exit(f"{case}: the sealed file decodes differently ({before} != {after}); nothing was written")
        writes.append(store.Write(case, new_bytes, entry.provenance, f"{REASON}: content sha256 {before}"))
        done.append((case, before, len(old_bytes), len(new_bytes)))
    if writes and not dry_run:
        store.commit(golden_dir, writes)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("golden_dir", nargs="?", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    for case, digest, old, new in seal(args.golden_dir or default_golden_dir(), args.dry_run):
        print(f"{case}: content sha256 {digest} identical; {old} -> {new} bytes")


if __name__ == "__main__":
    main()
