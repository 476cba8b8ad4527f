"""The gate's own work: profiles, work shared between cases, cases over processes, the report cache."""

from __future__ import annotations

import json
import time

import pytest

from refcheck.profile import Profile, count, phase, timed


def test_profile_phases_are_exclusive_and_nest():
    prof = Profile()

    @timed("inner", counter="inner_calls")
    def inner() -> None:
        time.sleep(0.02)

    with prof.active():
        with phase("outer"):
            time.sleep(0.02)
            inner()
            inner()
            count("things", 3)
    assert prof.counts == {"inner_calls": 2, "things": 3}
    assert 0.035 <= prof.wall["inner"] < 0.2 and 0.015 <= prof.wall["outer"] < 0.1  # outer pauses while inner runs
    inner()  # no active profile: nothing recorded
    assert prof.counts["inner_calls"] == 2
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    again.merge(prof)
    assert again.counts == {"inner_calls": 4, "things": 6} and again.wall["inner"] == pytest.approx(2 * prof.wall["inner"], abs=1e-3)
