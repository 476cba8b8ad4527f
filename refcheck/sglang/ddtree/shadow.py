"""DDTree in shadow mode: the names its algorithm, worker and runner share (no SGLang import).

Contract: ``REFCHECK_DDTREE_SHADOW`` drafts and builds the DDTree of :data:`SHADOW_BUDGET_ENV` nodes and records
it, while SGLang verifies the chain of the block's top-1 drafts (:mod:`refcheck.sglang.ddtree.worker`).
"""

SHADOW_NAME = "REFCHECK_DDTREE_SHADOW"
#: the shadow tree's node budget (the runner sets it from ``--budget``; SGLang's own budget is the block's chain)
SHADOW_BUDGET_ENV = "REFCHECK_SHADOW_BUDGET"
