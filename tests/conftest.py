"""Shared fixtures: the built-in models on CPU in fp32, loaded once per test process."""

from __future__ import annotations

import logging
import os

# One thread per test process, and per process it spawns (they inherit the environment; refcheck's
# workers cap their share of the cores at OMP_NUM_THREADS, refcheck/parallel.py): pytest-xdist already
# runs one process per core, and torch's OpenMP threads on top of that oversubscribe the cores; under
# contention a tiny forward then took ~1 ms instead of ~12 us. Set before torch is imported.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"
# The suite starts hundreds of Python processes (the CLI, workers, shards, engines' stand-ins): each compiles
# refcheck's modules from source unless their bytecode is cached, ~0.3 s of CPU apiece. The cache goes where
# Python keeps it (__pycache__/, ignored by git), whatever PYTHONDONTWRITEBYTECODE the shell set.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts with one torch thread, whatever the test before it did (a command run inline
    may set its own share of the cores)."""
    torch.set_num_threads(1)
    yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the GPU machine)")
    config.addinivalue_line("markers", "sglang: needs SGLang installed (with gpu: a live engine; alone: its objects on the CPU)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 CPU cores")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    _keep_xdist_groups_together(config, items)

    no_gpu = not torch.cuda.is_available()
    no_sglang = importlib.util.find_spec("sglang") is None
    for item in items:
        if no_gpu and "gpu" in item.keywords:  # SGLang's live engine tests carry both markers
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        elif no_sglang and "sglang" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="SGLang is not installed (scripts/sglang_bundle.sh)"))


@pytest.fixture(scope="session")
def hybrid():
    from ddtree_reference.drafter import DFlashDrafter
    from ddtree_reference.target import Target
    from refcheck.models import builtin_pair

    tdir, ddir = builtin_pair("hybrid")
    target = Target.load(tdir)
    return target, DFlashDrafter.load(ddir, target)


@pytest.fixture(scope="session")
def attention():
    from ddtree_reference.drafter import DFlashDrafter
    from ddtree_reference.target import Target
    from refcheck.models import builtin_pair

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
def capture_dir(tmp_path, monkeypatch):
    """The SGLang capture hooks as a new scheduler process has them, recording into ``tmp_path``
    (tests/capture_kit.py: fresh_hooks)."""
    from capture_kit import fresh_hooks

    return fresh_hooks(monkeypatch, tmp_path)


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    """``make(mode, **runner_kwargs)``: an SGLangRunner against tests/fake_sglang, the stand-in SGLang whose
    behaviour ``mode`` chooses (no GPU needed: the GPU check is patched), its capture directory ``tmp_path / mode``."""
    import sys
    from pathlib import Path

    from refcheck.reference_runner import EngineSpec
    from refcheck.sglang.runner import SGLangRunner

    fake = str(Path(__file__).parent / "fake_sglang")
    monkeypatch.syspath_prepend(fake)
    monkeypatch.setenv("PYTHONPATH", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def make(mode: str, **kw):
        monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
        return SGLangRunner(EngineSpec(dtype="bfloat16", device="cuda", max_new_tokens=3), "NONE",
                            capture_dir=tmp_path / mode, **kw)
    return make


@pytest.fixture
def trace_file(tmp_path):
    """A small valid trace and its file (tests/trace_helpers.py), for the trace format and error tests."""
    from trace_helpers import make_trace_file

    return make_trace_file(tmp_path)


def _keep_xdist_groups_together(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker, so that a module
    fixture they share is computed once. pytest-xdist (3.8) marks a test's group by appending
    ``@GROUP`` to ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``item._id``): the
    groups were silently split over the workers and each worker computed the shared fixture again.
    Here each xdist worker gives its grouped items the id xdist meant (nothing to do where xdist's
    own suffix took effect)."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9: xdist's own suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)
