"""A stand-in for ``sglang`` (tests only): an Engine whose behaviour FAKE_SGLANG_MODE chooses.

ok: echo greedy-looking outputs; drift: like ok, but every generate after the first answers
differently (a nondeterministic engine); start_fail: print a scheduler traceback and fail at start-up the
way SGLang does; crash: die (SIGKILL-like exit) in the middle of generate; hang: start a stand-in scheduler (a
process in the engine's process group, as SGLang's are; its pid in FAKE_SGLANG_SCHEDULER_PID when that names a
file) and never return; first_fails_second_hangs: a generate of the first workload's requests prints a scheduler
error and raises, one of a later workload's (rids ``refcheck-PID-K.I-ID``, K > 0) never returns.
"""

import asyncio
import os
import re
import subprocess
import sys
import time

__version__ = "0.0-fake"


class Engine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = 0
        self.loop = asyncio.new_event_loop()  # SGLang's Engine runs its tokenizer manager on its own loop
        mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
        if mode == "start_fail":
            print("Traceback (most recent call last):", file=sys.stderr)
            print("RuntimeError: gemma_rmsnorm failed to dispatch data type Float", file=sys.stderr)
            raise RuntimeError("Initialization failed. Please see the error messages above.")

    def generate(self, input_ids, sampling_params, rid=None):
        mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
        if mode == "crash":
            print("ValueError: scheduler hit an illegal memory access", file=sys.stderr, flush=True)
            os._exit(137)
        if mode == "hang":
            scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            if os.environ.get("FAKE_SGLANG_SCHEDULER_PID"):
                with open(os.environ["FAKE_SGLANG_SCHEDULER_PID"], "w") as f:
                    f.write(str(scheduler.pid))
            time.sleep(3600)
        if mode == "first_fails_second_hangs":
            if any(re.search(r"refcheck-\d+-\d+\.\d+-", r) for r in rid):
                time.sleep(3600)
            print("ValueError: part0 bad request", file=sys.stderr, flush=True)
            raise ValueError("part0 bad request")
        shift = self.calls if mode == "drift" else 0
        self.calls += 1
        return [{"output_ids": [ids[-1] + shift] * sp["max_new_tokens"], "meta_info": {"id": r}}
                for ids, sp, r in zip(input_ids, sampling_params, rid)]

    async def async_generate(self, input_ids, sampling_params, rid=None):
        """One request (the staggered-arrival path): its output, and when it arrived."""
        out = self.generate([input_ids], [sampling_params], [rid])[0]
        out["meta_info"]["arrived"] = time.time()
        return out

    def shutdown(self):
        pass
