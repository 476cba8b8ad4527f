"""The hidden-state ceiling REFCHECK_DDTREE runs SGLang with (imports nothing from SGLang).

Contract: :data:`HIDDEN_STATES_CEILING` is the ``return_hidden_states_mode`` the algorithm's server-args
check sets (:mod:`refcheck.sglang.ddtree.algorithm`): SGLang captures the target's CUDA graphs at it, and
the verify needs every node's hidden states for the drafter. :func:`hidden_states_ceiling_is_full` is
SGLang 0.5.17's own reading of the server arguments, which the worker (:mod:`refcheck.sglang.ddtree.worker`)
checks before it starts. Both modules import it from here (the algorithm also loads the worker).
"""

from __future__ import annotations

#: the server's hidden-state ceiling the algorithm runs with (SGLang's ``return_hidden_states_mode``): the
#: target's CUDA graphs are captured with it, and the verify needs every node's hidden states
HIDDEN_STATES_CEILING = "full"


def hidden_states_ceiling_is_full(server_args) -> bool:
    """Whether SGLang 0.5.17's ``get_server_return_hidden_states_mode(server_args)`` is ``FULL``
    (``forward_batch_info.py:234-240``: ``"last"`` wins over ``enable_return_hidden_states``)."""
    mode = getattr(server_args, "return_hidden_states_mode", None)
    if mode == "last":
        return False
    return mode == "full" or bool(getattr(server_args, "enable_return_hidden_states", False))
