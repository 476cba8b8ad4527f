#!/usr/bin/env python
"""Train the built-in byte-level BPE tokenizer on the generated corpus (deterministic).

Writes refcheck/models/tokenizer.json: vocab 512, special tokens <|endoftext|> (id 0, document
separator and stop token) and <|mask|> (id 1, the DFlash drafter's MASK input).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from refcheck.models import MODELS_DIR
from refcheck.models.corpus import generate_corpus

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|mask|>"]


def build(seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((t for _, t in generate_corpus(seed)), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=MODELS_DIR / "tokenizer.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = build(args.seed)
    tok.save(str(args.out))
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, mask id {tok.token_to_id('<|mask|>')}")


if __name__ == "__main__":
    main()
