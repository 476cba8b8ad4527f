"""Serving workloads: generated prompt sets shaped like production traffic, for the SGLang settings matrix.

Contract: :func:`workload(name, seed)` returns a list of :class:`~refcheck.prompts.Prompt` built from
the built-in corpus (:func:`refcheck.models.corpus.generate_corpus`) and tokenizer, the same on any
machine for the same arguments (no network, no files written). :func:`write_workload` writes one as
a prompts JSONL (``prompt_ids`` lines) that every command reads with ``--prompts``. The sets:

* ``builtin``: the six built-in prompts (what the goldens use);
* ``mixed``: 32 requests, prompt lengths spread from 8 to ~600 tokens and new-token limits from 8 to
  64 (run staggered, they meet the running batch at every stage: prefill beside decode and verify;
  short limits finish early, so the batch changes size mid-run);
* ``shared-prefix``: 12 requests in 3 families sharing a ~300-token prefix, tails of different
  lengths (with the radix cache on, later requests resume from cached KV and recurrent state, some
  mid-prefix);
* ``long``: one prompt of 4 096 and one of 16 384 tokens beside two short ones (chunked prefill);
  needs a target whose context holds 16 448 positions (:func:`needed_context`).

Token ids stay below the built-in vocabulary (512): the sets run on the built-in pairs and on any
target with a larger vocabulary.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from refcheck.errors import UsageError
from refcheck.prompts import Prompt, load_prompts

WORKLOADS = ("builtin", "mixed", "shared-prefix", "long")
LONG_LENGTHS = (4096, 16384)


def _stream(seed: int, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` ids: corpus documents, tokenized with the built-in tokenizer, end to end."""
    from refcheck.models import builtin_pair
    from refcheck.models.corpus import generate_corpus
    from refcheck.prompts.tokenizer import PromptTokenizer

    tok = PromptTokenizer.from_model_dir(builtin_pair()[0])
    ids: list[int] = []
    docs = generate_corpus(seed, 64)
    k = 0
    while len(ids) < n_tokens:
        if k == len(docs):
            docs, k = generate_corpus(seed + len(ids), 64), 0  # a fresh, still deterministic, batch of documents
        ids.extend(tok.encode(docs[k][1]))
        k += 1
    return ids


def _mixed(seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    lengths = [8, 16, 600] + [rng.randint(8, 600) for _ in range(29)]
    stream = _stream(seed, sum(lengths))
    out, at = [], 0
    for i, n in enumerate(lengths):
        out.append(Prompt(f"mixed-{i:02d}", tuple(stream[at:at + n]), "mixed", rng.choice([8, 16, 32, 48, 64])))
        at += n
    return out


def _shared_prefix(seed: int) -> list[Prompt]:
    rng = random.Random(seed + 1)
    stream = _stream(seed + 1, 3 * 300 + 12 * 120)
    out, at = [], 0
    for fam in range(3):
        prefix = stream[at:at + 300]
        at += 300
        for j in range(4):
            n = rng.randint(4, 120)
            cut = 300 if j else rng.randint(100, 250)  # the first member shares only part of the prefix
            out.append(Prompt(f"prefix-{fam}-{j}", tuple(prefix[:cut] + stream[at:at + n]), "shared-prefix", 32))
            at += n
    return out


def _long(seed: int) -> list[Prompt]:
    stream = _stream(seed + 2, sum(LONG_LENGTHS) + 64)
    out = [Prompt("short-0", tuple(stream[:24]), "long", 32)]
    at = 24
    for n in LONG_LENGTHS:
        out.append(Prompt(f"long-{n}", tuple(stream[at:at + n]), "long", 32))
        at += n
    out.append(Prompt("short-1", tuple(stream[at:at + 40]), "long", 32))
    return out


def workload(name: str, seed: int = 0) -> list[Prompt]:
    """The prompts of a named workload (UsageError naming the known ones)."""
    if name == "builtin":
        return load_prompts()
    makers = {"mixed": _mixed, "shared-prefix": _shared_prefix, "long": _long}
    if name not in makers:
        raise UsageError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return makers[name](seed)


def needed_context(prompts: list[Prompt], default_new: int) -> int:
    """Positions a target's context must hold for these prompts (prompt plus new tokens, the longest)."""
    return max(len(p.prompt_ids) + (p.max_new_tokens or default_new) for p in prompts)


def write_workload(prompts: list[Prompt], path: Path) -> Path:
    """A prompts JSONL of ``prompt_ids`` lines (what ``--prompts`` reads back to the same prompts)."""
    lines = [json.dumps({"id": p.id, "kind": p.kind, "prompt_ids": list(p.prompt_ids),
                         **({"max_new_tokens": p.max_new_tokens} if p.max_new_tokens else {})}) for p in prompts]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
