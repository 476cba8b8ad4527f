"""An engine refcheck's registry does not know, for tests/test_engines.py to add: adding an engine is this
module and one :class:`refcheck.engines.EngineKind` row.

``stub[:drop]`` decodes with the reference and reports its run as its own (a correct engine); with ``:drop``
it loses each request's last output token (the kind of off-by-one a detokenizing server makes), which the
diff must catch.
"""

from __future__ import annotations

from typing import Any

from refcheck.engines import Engine
from refcheck.pool import ReferencePool
from refcheck.reference_runner import EngineSpec, ReferenceRunner


class StubEngine:
    def __init__(self, name: str, spec: EngineSpec, drop_last: bool) -> None:
        self.name, self.spec, self.drop_last = name, spec, drop_last

    def trace(self, prompts):
        trace, _ = ReferenceRunner(self.spec).trace(prompts, engine=self.name)
        if self.drop_last:
            for r in trace.requests:
                r.output_ids = r.output_ids[:-1]
        return trace


def open_stub(engine: str, spec: EngineSpec, pool: ReferencePool | None, full_state: bool,
              options: dict[str, Any]) -> Engine:
    return StubEngine(engine, spec, engine.endswith(":drop"))
