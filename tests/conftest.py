"""Shared fixtures: the built-in models on CPU in fp32, loaded once per test process."""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the GPU machine)")
    config.addinivalue_line("markers", "sglang: needs SGLang installed")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 CPU cores")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    no_gpu = not torch.cuda.is_available()
    no_sglang = importlib.util.find_spec("sglang") is None
    for item in items:
        if no_gpu and ("gpu" in item.keywords or "sglang" in item.keywords):
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        elif no_sglang and "sglang" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="SGLang is not installed (scripts/sglang_bundle.sh)"))


@pytest.fixture(scope="session")
def hybrid():
    from refcheck.models import builtin_pair
    from reference.drafter import DFlashDrafter
    from reference.target import Target

    tdir, ddir = builtin_pair("hybrid")
    target = Target.load(tdir)
    return target, DFlashDrafter.load(ddir, target)


@pytest.fixture(scope="session")
def attention():
    from refcheck.models import builtin_pair
    from reference.drafter import DFlashDrafter
    from reference.target import Target

    tdir, ddir = builtin_pair("attention")
    target = Target.load(tdir)
    return target, DFlashDrafter.load(ddir, target)


@pytest.fixture(params=["hybrid", "attention"])
def pair(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run the refcheck console entry in-process: cli(*args) -> (exit code, stdout, stderr)."""
    import sys

    from refcheck.cli import entry

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["refcheck", *args])
        with pytest.raises(SystemExit) as exc:
            entry()
        out = capsys.readouterr()
        return int(exc.value.code or 0), out.out, out.err

    return run


@pytest.fixture
def trace_file(tmp_path):
    """A small valid trace and its file (tests/trace_helpers.py), for the trace format and error tests."""
    from trace_helpers import make_trace_file

    return make_trace_file(tmp_path)
