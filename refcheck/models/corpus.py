"""The built-in training corpus: generated text of three kinds, reproducible without a network.

Contract: ``generate_corpus(seed, n_docs)`` returns the same list of documents for the same
arguments on any machine (pure Python ``random.Random``; no torch, no files). Three kinds, so
acceptance differs across them like it does across real datasets: ``code`` (small Python-like
functions and loops), ``arithmetic`` (sums, products and counting sequences, always correct) and
``prose`` (sentences from a small grammar). ``corpus_sha256`` identifies a generated corpus in the
models' provenance.
"""

from __future__ import annotations

import hashlib
import random

KINDS = ("code", "arithmetic", "prose")

_NAMES = ["total", "count", "value", "index", "result", "item", "score", "size", "limit", "step", "left", "right"]
_FUNCS = ["add", "scale", "shift", "clip", "mix", "fold", "pick", "merge", "split", "count", "sum", "check"]
_NOUNS = ["cat", "dog", "river", "city", "teacher", "garden", "window", "student", "train", "forest", "market",
          "child", "bird", "mountain", "doctor", "road", "farmer", "ship", "library", "storm"]
_ADJS = ["small", "quiet", "old", "bright", "green", "tall", "cold", "busy", "gentle", "dark", "happy", "young"]
_VERBS = ["sees", "follows", "finds", "watches", "helps", "crosses", "reaches", "leaves", "visits", "passes"]
_PREPS = ["near", "behind", "under", "beside", "across", "around"]
_TIMES = ["In the morning", "At night", "Every day", "After the rain", "Before noon", "In the winter"]


def _code(rng: random.Random) -> str:
    f, a, b = rng.choice(_FUNCS), rng.choice(_NAMES), rng.choice(_NAMES)
    k, n = rng.randint(1, 9), rng.randint(2, 9)
    op = rng.choice(["+", "-", "*"])
    lines = [f"def {f}_{k}({a}):", f"    {b} = 0", f"    for i in range({n}):", f"        {b} = {b} {op} {a}"]
    if rng.random() < 0.5:
        lines += [f"    if {b} > {k * 10}:", f"        {b} = {k * 10}"]
    lines += [f"    return {b}", ""]
    return "\n".join(lines)


def _arithmetic(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(3, 6)):
        kind = rng.random()
        if kind < 0.4:
            x, y = rng.randint(1, 99), rng.randint(1, 99)
            out.append(f"{x} + {y} = {x + y}.")
        elif kind < 0.7:
            x, y = rng.randint(1, 12), rng.randint(1, 12)
            out.append(f"{x} * {y} = {x * y}.")
        else:
            start, step = rng.randint(0, 20), rng.randint(1, 5)
            out.append(", ".join(str(start + i * step) for i in range(rng.randint(5, 9))) + ".")
    return " ".join(out)


def _prose(rng: random.Random) -> str:
    sents = []
    for _ in range(rng.randint(2, 4)):
        s = (f"The {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} "
             f"{rng.choice(_PREPS)} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}.")
        if rng.random() < 0.4:
            s = f"{rng.choice(_TIMES)}, " + s[0].lower() + s[1:]
        sents.append(s)
    return " ".join(sents)


_MAKERS = {"code": _code, "arithmetic": _arithmetic, "prose": _prose}


def generate_corpus(seed: int = 0, n_docs: int = 30000) -> list[tuple[str, str]]:
    """[(kind, text)] with the three kinds in equal proportion, deterministic in (seed, n_docs)."""
    rng = random.Random(seed)
    return [(KINDS[i % 3], _MAKERS[KINDS[i % 3]](rng)) for i in range(n_docs)]


def corpus_sha256(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for kind, text in docs:
        h.update(kind.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()
