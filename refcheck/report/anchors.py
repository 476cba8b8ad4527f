"""Element ids of the report page: one scheme, so every link the page makes resolves.

Contract: a request's id in the page is its position in the trace (``q0``, ``q1``, ...), never its
name (request ids are text from a file); a step is ``q<i>-s<step>``, a tree node
``q<i>-s<step>-n<node>``, the k-th listed finding ``f<k>``. A request the trace does not list
(a finding about the whole run) has no anchor: :meth:`Anchors.request` returns None for it.
"""

from __future__ import annotations

from collections.abc import Iterable


class Anchors:
    """The page's ids for the requests of one trace."""

    def __init__(self, request_ids: Iterable[str]) -> None:
        self._index = {rid: i for i, rid in enumerate(request_ids)}

    def request(self, request_id: str | None) -> str | None:
        i = self._index.get(request_id) if request_id is not None else None
        return None if i is None else f"q{i}"

    def step(self, request_id: str | None, step: int) -> str | None:
        base = self.request(request_id)
        return None if base is None else f"{base}-s{step}"

    def node(self, request_id: str | None, step: int, node: int) -> str | None:
        base = self.step(request_id, step)
        return None if base is None else f"{base}-n{node}"

    @staticmethod
    def finding(k: int) -> str:
        return f"f{k}"
