"""The oracles' guess (ddtree_reference/oracle.py): one forward of prompt + an engine's output settles every
prefix of it that the forward decides by more than the guess margins, and the result is the plain
loop's, token for token (and margin for margin at the first difference), whatever the guess; the
margins hold because the rows of a longer forward differ from a prefix's own forward by rounding only,
which this module measures on both built-in targets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_reference.compat import full_forward_logits
from ddtree_reference.oracle import (
    GUESS_CDF_MARGIN,
    GUESS_MARGIN,
    GUESS_SAFETY,
    GreedyMemo,
    greedy_decode,
    sample_decode,
)
from ddtree_reference.sampling import Sampling

PROMPT = [3, 17, 42, 8, 99, 5, 61]


@pytest.mark.parametrize("pair", ["hybrid", "attention"])
def test_a_longer_forward_moves_a_prefix_row_far_less_than_the_guess_margin(pair, request):
    """Position q's logits from the forward of 300 tokens against those of the forward of its own prefix
    (the Gated DeltaNet layers' 64-token chunks fall differently): rounding (1.5e-5 of a logit at most
    here), more than GUESS_SAFETY times below both margins."""
    target, _ = request.getfixturevalue(pair)
    seq = torch.randint(0, target.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    full = full_forward_logits(target.model, seq)  # [300, V]
    worst = max(float((full_forward_logits(target.model, seq[: q + 1])[-1] - full[q]).abs().max())
                for q in (0, 20, 63, 64, 65, 130, 200, 256, 299))
    assert 0 < worst and GUESS_SAFETY * worst < GUESS_MARGIN / 10
    assert GUESS_SAFETY * 2 * worst < GUESS_CDF_MARGIN  # (used at T = 1: a CDF edge moves <= 2 max |d logit| / T)


def test_a_guess_whose_forward_drifts_settles_nothing(hybrid, greedy_hybrid, monkeypatch):
    """Where the long forward's rows differ from the prefixes' own by more than the margins allow (a model or
    device that rounds coarsely), the guess is not used: the loop runs every prefix, and is right."""
    import ddtree_reference.oracle as oracle

    target, _ = hybrid
    real = oracle._guess_rows
    monkeypatch.setattr(oracle, "_guess_rows", lambda *a: (real(*a)[0], GUESS_MARGIN / GUESS_SAFETY))
    memo = GreedyMemo(target.model)
    assert memo.decode(PROMPT, 40, guesses=[greedy_hybrid]) == greedy_hybrid and memo.forwards == 3 + 40
    s = Sampling(temperature=1.0, seed=7)
    assert sample_decode(target.model, PROMPT, 12, s, 3, guesses=[greedy_hybrid]) == sample_decode(target.model, PROMPT, 12, s, 3)


@pytest.fixture(scope="module")
def greedy_hybrid(hybrid):
    target, _ = hybrid
    return greedy_decode(target.model, PROMPT, 40)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 40), replace=st.integers(0, 499), extra=st.integers(0, 5))
def test_greedy_with_any_guess_is_the_plain_loop(hybrid, greedy_hybrid, cut, replace, extra):
    """A guess right up to token ``cut`` and wrong after it (or longer than the limit): the memo returns the
    plain loop's continuation; a right guess costs one forward, a wrong one the loop from where it errs."""
    target, _ = hybrid
    want = greedy_hybrid
    guess = want[:cut] + ([replace] if cut < 40 else []) + [1] * extra
    memo = GreedyMemo(target.model)
    assert memo.decode(PROMPT, 40, guesses=[guess]) == want
    right = cut == 40 or replace == want[cut]
    if right and extra == 0:
        assert memo.forwards <= 3 + 2  # the forward and its two probes (and a prefix or two left unsettled)
    assert memo.forwards <= 3 + (40 - cut) + 2


def test_greedy_guess_stops_at_stop_tokens(hybrid, greedy_hybrid):
    target, _ = hybrid
    stop = {greedy_hybrid[9]}
    want = greedy_decode(target.model, PROMPT, 40, stop)
    memo = GreedyMemo(target.model)
    assert memo.decode(PROMPT, 40, stop, guesses=[greedy_hybrid]) == want == greedy_hybrid[: greedy_hybrid.index(greedy_hybrid[9]) + 1]


@pytest.fixture(scope="module")
def sampled_hybrid(hybrid):
    target, _ = hybrid
    s = Sampling(temperature=1.0, seed=7)
    return s, sample_decode(target.model, PROMPT, 40, s, 3)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 40), replace=st.integers(0, 499))
def test_sampling_with_any_guess_is_the_plain_loop(hybrid, sampled_hybrid, cut, replace):
    """The sampled oracle with a guess: the same tokens as without one, and each draw's edge distance within
    rounding of the loop's (exactly the loop's from the first prefix the guess does not settle)."""
    target, _ = hybrid
    s, (want, margins) = sampled_hybrid
    guess = want[:cut] + ([replace] if cut < 40 else [])
    got, got_margins = sample_decode(target.model, PROMPT, 40, s, 3, guesses=[guess])
    assert got == want and len(got_margins) == len(margins)
    assert max(abs(a - b) for a, b in zip(got_margins, margins)) < 1e-5
    assert got_margins[cut:] == margins[cut:]  # the loop's own values after the guess's first error


def test_a_second_guess_settles_what_follows_where_the_first_errs(hybrid, greedy_hybrid, sampled_hybrid, monkeypatch):
    """Guesses in order (the engine's output, then the reference's own run): where the first leaves the
    oracle, the second settles the rest in its own forward instead of the loop's one per token; a guess that
    does not continue what is settled is skipped; the result is the loop's either way."""
    import ddtree_reference.oracle as oracle

    target, _ = hybrid
    calls = {"n": 0}
    real = oracle.full_forward_logits

    def counted(model, ids):
        calls["n"] += 1
        return real(model, ids)

    monkeypatch.setattr(oracle, "full_forward_logits", counted)
    want = greedy_hybrid
    wrong = want[:10] + [(want[10] + 1) % 500] + want[11:]
    memo = GreedyMemo(target.model)
    assert memo.decode(PROMPT, 40, guesses=[wrong, [7, 7, 7], want]) == want and memo.forwards <= 9 + 2
    s, (swant, smargins) = sampled_hybrid
    calls["n"] = 0
    swrong = swant[:5] + [(swant[5] + 1) % 500] + swant[6:]
    got, got_margins = sample_decode(target.model, PROMPT, 40, s, 3, guesses=[swrong, [1, 2], swant])
    assert got == swant and max(abs(a - b) for a, b in zip(got_margins, smargins)) < 1e-5
    near_edges = sum(m <= GUESS_CDF_MARGIN for m in smargins)  # draws the long forward leaves to their own prefix
    assert calls["n"] <= 2 * 3 + 1 + near_edges < 40  # two guesses' forwards and probes, the draw where the first errs
