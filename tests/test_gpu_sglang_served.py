"""Live SGLang, slice "served": a server refcheck did not start (``python -m sglang.launch_server``, requests over
HTTP) captured through its environment (``REFCHECK_CAPTURE_DIR``, one batch in two, a byte budget), turned into a
trace by ``refcheck trace import``'s code and diffed (markers ``sglang`` and ``gpu``; skipped without a GPU and
SGLang).

On the H200: ``scripts/sglang_bundle.sh run python3 -m pytest -m sglang tests/test_gpu_sglang_served.py``. One
DFLASH server on the built-in hybrid pair, bf16, with overlap scheduling and CUDA graphs (SGLang's defaults), six
prompts of 32 new tokens, greedy, prefill chunks of 16 tokens (two prompts are longer). The requests ignore the
model's end-of-sequence token (as ``refcheck diff``'s own do): the built-in target's greedy first token of one prompt
is its ``eos_token_id`` 0, and a request that ends at its prefill has no decode step, so under one-in-two sampling
it is in the trace only when the rule takes its prefill batch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gpu_sglang_kit import diff_on_gpu, hybrid_spec, structural_failures

from refcheck.models import builtin_pair
from refcheck.prompts import load_prompts

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]


#: the server's prefill chunk, in tokens: two of the six built-in prompts (17 and 24 tokens) are longer, so their first
#: tokens come from a last chunk and a middle chunk's sampled token must not be recorded as one
CHUNK = 16


def _flags(kw: dict) -> list[str]:
    """``sglang.Engine`` keyword arguments as ``launch_server`` flags (False and None: SGLang's default)."""
    out: list[str] = []
    for name, value in kw.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def _post(url: str, body: dict, timeout: float) -> object:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the local server just started
        return json.loads(resp.read())


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, limit_s: float = 420.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}) before it was healthy; log: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:  # noqa: S310
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"the server was not healthy within {limit_s:.0f} s; log: {log.read_text()[-3000:]}")


def _end(server: subprocess.Popen) -> None:
    """End the server's process group (gone already: nothing to do), killing it if it does not end in 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    """A DFLASH server started as a user starts one, six prompts sent over HTTP; (its capture directory, the outputs
    by rid, the prompts by rid)."""
    from refcheck.sglang.capture.shipper import wait_drained
    from refcheck.sglang.runner import engine_kwargs, install_entry_point
    from refcheck.sglang.settings import parse_settings

    root = tmp_path_factory.mktemp("served")
    install_entry_point(root / "site")  # the plugin's entry point on PYTHONPATH, as an installed refcheck has it
    tdir, ddir = builtin_pair("hybrid")
    # overlap scheduling and CUDA graphs as SGLang serves by default, prefill chunks of CHUNK tokens; the radix cache
    # off: on this hybrid target (no mamba extra buffer in 0.5.17) it would turn the overlap scheduler off
    settings = parse_settings(f"overlap,graphs,chunk={CHUNK}")
    kw = engine_kwargs(hybrid_spec(), str(tdir), "DFLASH", budget=15, draft_path=str(ddir), settings=settings)
    kw.pop("model_path")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "REFCHECK_CAPTURE_DIR": str(root / "capture"), "REFCHECK_CAPTURE_SAMPLE": "2:1",
           "REFCHECK_CAPTURE_MAX_BYTES": str(256 << 20)}
    log = root / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tdir), "--host", "127.0.0.1", "--port",
           str(port), *_flags(kw)]
    with open(log, "w") as out:  # its own process group: the server's scheduler and detokenizer end with it
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log)
        prompts = load_prompts()
        assert any(len(p.prompt_ids) > CHUNK for p in prompts) and any(len(p.prompt_ids) <= CHUNK for p in prompts)
        got = _post(url + "/generate", {"input_ids": [list(p.prompt_ids) for p in prompts],
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                            "ignore_eos": True}}, timeout=300)
        assert isinstance(got, list) and len(got) == len(prompts), got
        outputs = {g["meta_info"]["id"]: list(g["output_ids"]) for g in got}
        by_rid = {g["meta_info"]["id"]: p for g, p in zip(got, prompts)}
        assert not wait_drained(root / "capture", timeout_s=60.0)
    finally:
        _end(server)
    return root / "capture", outputs, by_rid


def test_the_capture_of_a_server_refcheck_did_not_start_is_a_trace_that_passes(served_run):
    """The directory alone gives every request's prompt and an output that agrees with what the server returned (the
    chunked prompts' first tokens included), the steps one batch in two, and a diff without structural or state
    failures (the server's own warm-up request, when it sends one, is a request of the trace too)."""
    from refcheck.sglang.served import served_trace

    records, outputs, by_rid = served_run
    served = served_trace(records)
    trace = served.assembly.trace
    assert not trace.provenance["capture"]["errors"], trace.provenance["capture"]["errors"]
    kept = {r.request_id: r for r in trace.requests}
    assert set(outputs) <= set(kept), (sorted(outputs), sorted(kept), served.left_out)
    for rid in outputs:
        r = kept[rid]
        n = min(len(r.output_ids), len(outputs[r.request_id]))
        assert r.prompt_ids == list(by_rid[r.request_id].prompt_ids) and n > 0
        assert r.output_ids[:n] == outputs[r.request_id][:n]
    assert trace.steps and trace.provenance["capture"]["sample"] == {"every": 2, "seed": 1}
    rep = diff_on_gpu(trace, "sglang-served-dflash", mode="replay")
    assert not structural_failures(rep), structural_failures(rep)
