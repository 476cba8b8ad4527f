"""refcheck/sglang/capture/header_codec.py: a capture header reads back as JSON would give it, refuses what JSON
refuses, and its loader builds nothing but JSON's values whoever wrote the bytes."""

from __future__ import annotations

import collections
import enum
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refcheck.sglang.capture import header_codec

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5) | st.booleans() | st.none(), inner, max_size=4),
    max_leaves=20)


@given(_JSON)
def test_a_json_value_reads_back_as_json_gives_it(value):
    assert header_codec.loads(header_codec.dumps(value)) == json.loads(json.dumps(value))


class _Rank(enum.IntEnum):
    TOP = 3


class _Temperature(float):
    pass


def test_subclasses_of_json_types_go_as_their_base_values_as_json_writes_them():
    point = collections.namedtuple("point", "x y")
    value = {"rank": _Rank.TOP, "t": _Temperature(0.5), "od": collections.OrderedDict(a=[point(1, 2)]),
             "dd": collections.defaultdict(list, b=[1]), "np_float": np.float64(0.25), "nan": math.nan}
    back = header_codec.loads(header_codec.dumps(value))
    want = json.loads(json.dumps(value))
    assert math.isnan(back.pop("nan")) and math.isnan(want.pop("nan"))
    assert back == want == {"rank": 3, "t": 0.5, "od": {"a": [[1, 2]]}, "dd": {"b": [1]}, "np_float": 0.25}
    assert [type(v) for v in back.values()] == [int, float, dict, dict, float]


@pytest.mark.parametrize("bad", [np.int64(3), np.float32(1.0), torch.tensor(1), object(), range(3)])
def test_what_json_refuses_is_refused_when_written(bad):
    """A type JSON has no value for is a TypeError, as json.dumps raises (sets and bytes, which the pickler writes
    natively, are refused when read: the last test)."""
    with pytest.raises(TypeError, match="is not JSON serializable"):
        header_codec.dumps({"record": [bad]})
    with pytest.raises(TypeError):
        json.dumps({"record": [bad]})


class _Boom:
    def __reduce__(self):
        return os.system, ("echo pwned > /dev/null",)


@pytest.mark.parametrize("data, message", [
    (pickle.dumps({"a": _Boom()}), "names posix.system"),
    (pickle.dumps(collections.OrderedDict(a=1)), "names collections.OrderedDict"),
    (header_codec.dumps({"a": [1, 2, 3]})[:-4], "not a capture record header"),
    (b"", "not a capture record header"),
    (pickle.dumps({1, 2}), "holds a set"),
    (pickle.dumps({"b": b"raw"}), "holds a bytes"),
    (pickle.dumps({(1, 2): 0}), "has a tuple key"),
])
def test_bytes_that_are_not_a_header_of_json_values_are_a_value_error_and_run_nothing(data, message):
    with pytest.raises(ValueError, match=message):
        header_codec.loads(data)
