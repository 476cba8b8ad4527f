"""refcheck: correctness verification and reference diffs for tree speculative decoding."""

__version__ = "0.1.0"
