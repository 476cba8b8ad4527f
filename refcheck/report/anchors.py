"""Element ids of the report page: one scheme, so every link the page makes resolves.

Contract: a request's id in the page is its position in the trace (``q0``, ``q1``, ...), never its
name (request ids are text from a file); a step is ``q<i>-s<step>``, a tree node
``q<i>-s<step>-n<node>``, the k-th listed finding ``f<k>``, and the page's named parts (``summary``,
``verdict``, ``counts``, ``findings``, ...) are :meth:`Anchors.fixed` ids. A request the trace does not
list (a finding about the whole run) has no anchor: :meth:`Anchors.request` returns None for it. A
page of several cases (:mod:`.cases`) gives each case's ids a prefix (``c3-q0-s5``, ``c3-summary``);
the page of one trace has none.
"""

from __future__ import annotations

from collections.abc import Iterable


class Anchors:
    """The page's ids for the requests of one trace, each with ``prefix`` in front."""

    def __init__(self, request_ids: Iterable[str], prefix: str = "") -> None:
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self.prefix = prefix

    def fixed(self, name: str) -> str:
        """The id of one of the page's named parts (``summary``, ``verdict``, ``findings``, ...)."""
        return f"{self.prefix}{name}"

    def request(self, request_id: str | None) -> str | None:
        i = self._index.get(request_id) if request_id is not None else None
        return None if i is None else f"{self.prefix}q{i}"

    def step(self, request_id: str | None, step: int) -> str | None:
        base = self.request(request_id)
        return None if base is None else f"{base}-s{step}"

    def node(self, request_id: str | None, step: int, node: int) -> str | None:
        base = self.step(request_id, step)
        return None if base is None else f"{base}-n{node}"

    def finding(self, k: int) -> str:
        return f"{self.prefix}f{k}"
