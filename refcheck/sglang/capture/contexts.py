"""Each recorded request's tokens and sampling parameters, carried by its records, so a capture describes its requests
without the run that sent them (a serving run's capture: :mod:`refcheck.sglang.served`).

Contract, the engine's side: at every batch it records, the hooks give each recorded request's record the tokens of
its context (prompt, then output) that no earlier record of that request carried: :func:`delta` of what was carried
before (``known``, kept per request by the step clock) and the request's ``origin_input_ids`` and ``output_ids`` as
the scheduler holds them before the batch runs; a request's first record also carries its sampling parameters
(:func:`params_of`). Each record thus holds ``[start, tokens, prompt length]`` per request, ``start`` being how many
context tokens came before. Over a request's life the records carry each context token once: a decode batch costs the tokens the
request gained since its last recorded batch (about ``every`` steps' worth under a sampled capture), a long prompt is
carried once.

The reader's side: :class:`Contexts` joins the pieces in write order. A piece that starts past what is known (a
record between them was lost, refused by the byte budget, or never written) leaves a hole: the request's context is
known up to it (:meth:`Contexts.known`), and the hole is said (:attr:`Contexts.holes`). A request whose first piece is
in no record read has no context (:attr:`Contexts.late`: where its pieces start). A piece that starts inside
what is known must agree with it, or the disagreement is said (:attr:`Contexts.conflicts`): the engine changed tokens
it had already emitted.
"""

from __future__ import annotations

from typing import Any

#: SamplingParams fields a record keeps (SGLang 0.5.17 names): what the target's distribution and stopping depend on
PARAMS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
          "min_new_tokens", "max_new_tokens", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag")


def delta(known: int, origin: Any, output: Any) -> list[int]:
    """The context tokens from position ``known`` on: the context is ``origin`` then ``output``."""
    n = len(origin)
    if known < n:
        return [*origin[known:], *output]
    return list(output[known - n:])


#: Req fields (SGLang 0.5.17 names) that make a request one the reference cannot judge from its token ids and
#: sampling parameters, kept as whether the request has them (a LoRA adapter's id as it is): other weights, a
#: distribution changed by code, a prompt whose ids are placeholders (embeddings, images), positions overridden
LOOKS = ("lora_id", "custom_logit_processor", "input_embeds", "multimodal_inputs", "positional_embed_overrides")


def params_of(req: Any) -> dict[str, Any] | None:
    """A request's sampling parameters (:data:`PARAMS` that it has; plain values) and what it carries of
    :data:`LOOKS` (``aborted``: SGLang finishes it at admission, ``to_finish`` set and its prompt replaced by a
    one-token stub, or finished it so), or None when it has no sampling parameters."""
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return None
    out: dict[str, Any] = {}
    for name in LOOKS:
        value = getattr(req, name, None)
        out[name] = value if value is None or isinstance(value, str) else True
    out["aborted"] = any(type(getattr(req, name, None)).__name__ == "FINISH_ABORT" for name in ("to_finish",
                                                                                                "finished_reason"))
    for name in PARAMS:
        value = getattr(sp, name, None)
        if value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, dict):
            out[name] = {str(k): float(v) for k, v in value.items()}
    return out


class Contexts:
    """Requests' contexts joined from their records' pieces (module docstring)."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._holed: set[str] = set()
        self.params: dict[str, dict[str, Any]] = {}  # rid -> its first record's sampling parameters
        self.prompt_lens: dict[str, int] = {}  # rid -> its prompt's length (where the output begins in its context)
        self.late: dict[str, int] = {}  # rid -> where its first piece starts, for a request none of whose pieces is first
        self.holes: list[str] = []
        self.conflicts: list[str] = []

    def add(self, rid: str, start: int, tokens: list[int], params: dict[str, Any] | None = None,
            prompt_len: int | None = None) -> None:
        """One record's piece of ``rid``'s context (and its parameters and prompt length, when it carried them)."""
        if params is not None and rid not in self.params:
            self.params[rid] = params
        if prompt_len is not None:
            self.prompt_lens.setdefault(rid, int(prompt_len))
        if rid in self._holed:
            return
        have = self._tokens.setdefault(rid, [])
        if start > len(have) and not have:  # its first piece is in no record read: no context at all
            self._holed.add(rid)
            self.late[rid] = start
            return
        if start > len(have):
            self._holed.add(rid)
            self.holes.append(f"{rid}: context tokens {len(have)}..{start - 1} are in no record (a record between was "
                              "not written); its context is known up to them")
            return
        overlap = have[start:start + len(tokens)]
        if overlap != tokens[:len(overlap)]:
            self.conflicts.append(f"{rid}: a record carries context tokens from {start} that differ from an earlier "
                                  "record's")
        have.extend(tokens[len(have) - start:])

    @classmethod
    def of(cls, records: Any) -> Contexts:
        """The contexts of step and prefill records (any order: each request's pieces are joined in the order they
        were carried, by where they start)."""
        contexts = cls()
        for r in sorted((r for r in records if r.context), key=lambda r: (r.rid, r.context[0])):
            contexts.add(r.rid, r.context[0], r.context[1], r.params, r.context[2] if len(r.context) > 2 else None)
        return contexts

    def differs(self, rid: str, whole: list[int]) -> int | None:
        """Where ``rid``'s carried context first differs from ``whole`` (its prompt and output), or None where they
        agree. A context longer than ``whole`` agrees when ``whole`` is its prefix: SGLang emits whole verify blocks
        and cuts the output at its token limit afterwards, so a step run past the end carries tokens the output
        lost."""
        return next((i for i, (a, b) in enumerate(zip(self.known(rid), whole)) if a != b), None)

    def known(self, rid: str) -> list[int]:
        """``rid``'s context as far as its records carry it without a hole."""
        return self._tokens.get(rid, [])

    def __contains__(self, rid: str) -> bool:
        return rid in self._tokens
