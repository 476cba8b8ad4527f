"""What the runner tells the code it loads into SGLang's processes, through their environment and request ids.

Contract: plain names, no imports. :data:`ENV_DIR` is the capture directory: the runner sets it, the capture
hooks (:mod:`refcheck.sglang.capture.hooks`) record into it only when it is set, and REFCHECK_DDTREE's worker
(:mod:`refcheck.sglang.ddtree.worker`) keeps its drafter's side of each step only then. :data:`ENV_FULL`
(``--full-state``) asks the hooks for the committed state's full rows beside its sketches; :data:`ENV_GRAPHS`
``=off`` makes them compute the state sketch eagerly instead of replaying it as a CUDA graph (to compare the
two, or where a graph cannot be captured). A request whose rid
starts with :data:`UNTRACED_RID_PREFIX` (a timing repeat) is neither synchronised nor recorded. Both the capture
and the algorithm import this module, and neither imports the other.
"""

from __future__ import annotations

ENV_DIR = "REFCHECK_CAPTURE_DIR"
ENV_FULL = "REFCHECK_CAPTURE_FULL"
ENV_GRAPHS = "REFCHECK_CAPTURE_GRAPHS"
#: requests whose rid starts with this are not captured (timing repeats: no synchronisation, no records)
UNTRACED_RID_PREFIX = "refcheck-untraced-"
