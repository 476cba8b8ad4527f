"""Budgets (refcheck/budget.py): every written form reads back as the value; anything else is refused
with where it came from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refcheck.budget import budget_from_json, budget_json, budget_label, parse_budget
from refcheck.errors import UsageError

budgets = st.none() | st.integers(min_value=0, max_value=10**6)


@given(budgets)
def test_every_written_form_reads_back(b):
    assert parse_budget(budget_label(b)) == b
    assert budget_from_json(budget_json(b)) == b
    assert parse_budget(f"  {budget_label(b).upper()} ") == b


@given(st.integers(max_value=-1) | st.text().filter(lambda t: t.strip().lower() != "chain" and not (t.strip().isascii() and t.strip().isdigit()))
       | st.sampled_from(["1_000", "1e3", "+3", "٣", "0x10", "15.0"])
       | st.floats() | st.booleans())
def test_anything_else_is_refused_naming_where(value):
    with pytest.raises(UsageError, match=r"^--x: budget must be"):
        parse_budget(value, "--x")
