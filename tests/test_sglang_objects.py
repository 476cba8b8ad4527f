"""SGLang's own objects, read as the capture reads them (marker ``sglang`` alone: SGLang installed, no GPU needed).

Run where SGLang imports: on a CPU machine ``scripts/sglang_bundle.sh cpu`` makes the environment, then
``PYTHONPATH=/tmp/sglang-bundle/site:. /tmp/sglang-cpu/bin/python -m pytest -o addopts= -m "sglang and not gpu"
tests/test_sglang_objects.py``; on the GPU machine through ``scripts/sglang_bundle.sh run``. Each name the capture
reads of SGLang (``refcheck/sglang/capture/versions.py``, ``contexts.py``) is checked against the release installed,
and the readings against real requests: a long prompt's chunks, a greedy request's normalised parameters, SGLang's
abort stub.
"""

from __future__ import annotations

import dataclasses
from array import array

import pytest

from refcheck.sglang.capture import contexts, versions

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt.managers import schedule_batch
    from sglang.srt.sampling.sampling_params import SamplingParams

    return schedule_batch, SamplingParams


def _req(sgl, rid: str = "a", prompt: int = 10, **params):
    schedule_batch, SamplingParams = sgl
    return schedule_batch.Req(rid, "", array("q", range(1, prompt + 1)), SamplingParams(**params))


def test_the_sampling_fields_the_records_keep_are_fields_of_this_releases_sampling_params(sgl):
    fields = set(sgl[1].__struct_fields__)
    assert set(contexts.PARAMS) <= fields, sorted(set(contexts.PARAMS) - fields)


def test_the_request_looks_the_records_keep_are_attributes_of_this_releases_requests(sgl):
    req = _req(sgl)
    assert all(hasattr(req, name) for name in contexts.LOOKS), [n for n in contexts.LOOKS if not hasattr(req, n)]


def test_the_server_fields_a_status_keeps_are_fields_of_this_releases_server_args():
    from sglang.srt.server_args import ServerArgs

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(versions.SERVER_FIELDS) <= names, sorted(set(versions.SERVER_FIELDS) - names)


def test_a_long_prompts_chunks_end_where_extend_range_says(sgl):
    """A 10-token prompt prefilled in chunks of 4: the chunk ends are read as the scheduler sets them, and only the
    last reaches the prompt's length."""
    req = _req(sgl)
    ends = []
    for start in range(0, 10, 4):
        req.set_extend_range(start, min(start + 4, 10))
        ends.append(versions.prefill_end(req))
    assert ends == [4, 8, 10] and len(req.origin_input_ids) == 10


def test_a_greedy_requests_parameters_read_plain_and_greedy(sgl):
    """SGLang turns temperature 0 into top-k 1; the record's parameters are plain values, no looks set."""
    from refcheck.sglang.served import _sampling_of

    got = contexts.params_of(_req(sgl, temperature=0, max_new_tokens=8))
    assert got is not None and got["top_k"] == 1 and got["max_new_tokens"] == 8
    assert all(got[name] is None for name in contexts.LOOKS) and got["aborted"] is False
    assert not isinstance(_sampling_of(got), str)


def test_sglangs_abort_stub_is_read_as_aborted(sgl):
    """A request SGLang finishes at admission (its prompt replaced by a one-token stub) is marked aborted."""
    req = _req(sgl, temperature=0)
    req.origin_input_ids, req.to_finish = array("q", [0]), sgl[0].FINISH_ABORT("refused")  # set_finish_with_abort
    got = contexts.params_of(req)
    assert got is not None and got["aborted"] is True


def test_a_request_with_a_lora_adapter_reads_its_id(sgl):
    schedule_batch, SamplingParams = sgl
    req = schedule_batch.Req("b", "", array("q", [1, 2]), SamplingParams(temperature=0), lora_id="adapter-3")
    got = contexts.params_of(req)
    assert got is not None and got["lora_id"] == "adapter-3"


def test_the_hooked_functions_exist_in_this_release():
    missing = []
    for name, target in versions.HOOK_TARGETS.items():
        if target.startswith(("refcheck.", "sgl_kernel.")):  # refcheck's own; a CUDA kernel module
            continue
        try:
            versions.resolve(target)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {target} ({exc})")
    assert not missing, missing


def test_this_releases_cuda_graph_config_reads_as_its_backends():
    from types import SimpleNamespace as NS

    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    decode, prefill = versions.graph_backends(NS(cuda_graph_config=CudaGraphConfig()))
    assert decode == "full" and prefill in ("breakable", "tc_piecewise")
    off = CudaGraphConfig(decode=PhaseConfig(backend="disabled"))
    assert versions.serving_of(NS(server_args=NS(cuda_graph_config=off)))["cuda_graphs"] is False
