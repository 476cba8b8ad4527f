"""Hypothesis strategies shared by the tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def rooted_parents(draw: st.DrawFn, max_nodes: int = 40) -> list[int]:
    """[N] parents of a rooted tree, node 0 the root (-1), every parent before its child."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
