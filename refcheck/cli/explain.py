"""``refcheck explain``: which counterfactual makes the reference say what the engine said at one node."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click
from rich.table import Table

from refcheck.cli.app import err, main, quiet
from refcheck.cli.options import DeviceType
from refcheck.errors import EXIT_PASS


@main.command()
@click.argument("trace_path", type=click.Path(path_type=Path))
@click.option("--request", "request_id", required=True, help="Request id (as in the diff's findings).")
@click.option("--step", type=int, required=True, help="Verify step of that request.")
@click.option("--node", type=int, required=True, help="Node of that step's tree.")
@click.option("--ref-dtype", default="float32", show_default=True)
@click.option("--ref-device", type=DeviceType(), default="cpu", show_default=True)
@click.option("--top", type=int, default=8, show_default=True, help="Hypotheses shown, best fit first.")
@click.option("--layer", "at_layer", is_flag=False, flag_value=-1, type=int, default=None,
              help="Explain at one layer instead (needs the trace's layer sketches): --layer alone takes the node's "
                   "first differing layer, --layer L that layer.")
@click.option("--json", "as_json", is_flag=True)
def explain(trace_path, request_id, step, node, ref_dtype, ref_device, top, at_layer, as_json):
    """Re-verify one node of an engine trace under counterfactuals: the per-path oracle, other input
    tokens, other recurrent (Gated DeltaNet) parents, other attention visibility. Says which ones
    reproduce what the engine computed there; the flattened-tree leak shows as the previous node in
    flat order."""
    from refcheck.diff.explain import explain_node
    from refcheck.pool import ReferencePool, reference_spec_for
    from refcheck.trace.io import read_trace

    quiet()
    trace = read_trace(trace_path)
    target = ReferencePool().runner(reference_spec_for(trace, ref_dtype, ref_device)).target
    if at_layer is not None:
        _explain_layer(trace, request_id, step, node, target, None if at_layer < 0 else at_layer, top, as_json)
    ex = explain_node(trace, request_id, step, node, target)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(ex), indent=2))
        sys.exit(EXIT_PASS)
    fmt = lambda pairs: ", ".join(f"{t}:{lp:.2f}" for t, lp in pairs)  # noqa: E731
    err.print(f"{request_id} step {step} node {node}: token {ex.token}, parent {ex.parent}, depth {ex.depth}", markup=False)
    err.print(f"  engine top-k     {fmt(ex.engine_topk)}", markup=False)
    err.print(f"  reference top-k  {fmt(ex.reference_topk)}", markup=False)
    table = Table(title=f"counterfactuals, best fit first (tolerance {ex.tolerance:g})")
    for col in ("hypothesis", "fit (max |Δ log-prob|)", "reference argmax", "explains"):
        table.add_column(col)
    shown = [ex.hypotheses[0], ex.hypotheses[1]] + sorted(ex.hypotheses[2:], key=lambda h: h.fit)[:top]
    for h in shown:
        table.add_row(h.detail, f"{h.fit:.3f}", str(h.argmax) if h.argmax >= 0 else "-",
                      "[green]yes[/]" if h.explains else "")
    err.print(table)
    err.print(f"reference vs the per-path oracle at this node: max |Δ log-prob| {ex.oracle_vs_reference:.3g} over the "
              "vocabulary", markup=False)
    exact = ex.hypotheses[0]
    if exact.fit <= ex.tolerance:
        err.print("the exact reference already fits the engine here: nothing to explain", markup=False)
    elif ex.explained_by:
        err.print(f"explained by: {ex.explained_by[0].detail}", markup=False)
    else:
        err.print("no counterfactual reproduces the engine here: not a wrong token, recurrent parent or attention "
                  "visibility at this node", markup=False)
    sys.exit(EXIT_PASS)


def _explain_layer(trace, request_id, step, node, target, layer, top, as_json) -> None:
    from refcheck.diff.layer_explain import explain_layer

    ex = explain_layer(trace, request_id, step, node, target, layer)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(ex), indent=2))
        sys.exit(EXIT_PASS)
    err.print(f"{request_id} step {step} node {node}: layer {ex.layer} ({ex.layer_type}), rel L2 of the engine's layer "
              f"output sketch vs the reference (this node / median of the others):", markup=False)
    err.print("  " + "  ".join(f"L{i} {a:.3f}/{b:.3f}" for i, (a, b) in enumerate(zip(ex.per_layer, ex.median_other_nodes))),
              markup=False)
    table = Table(title=f"layer {ex.layer} counterfactuals, best fit first (tolerance {ex.tolerance:g})")
    for col in ("hypothesis", "rel L2 to the engine", "explains"):
        table.add_column(col)
    for h in [ex.hypotheses[0]] + sorted(ex.hypotheses[1:], key=lambda h: h.rel_l2)[:top]:
        table.add_row(h.detail, f"{h.rel_l2:.3f}", "[green]yes[/]" if h.explains else "")
    err.print(table)
    if ex.hypotheses[0].rel_l2 <= ex.tolerance:
        err.print(f"layer {ex.layer} already agrees at this node: nothing to explain", markup=False)
    elif ex.explained_by:
        err.print(f"explained by: {ex.explained_by[0].detail}", markup=False)
    else:
        kinds = sorted({h.kind for h in ex.hypotheses[1:]})
        err.print(f"no counterfactual reproduces the engine at layer {ex.layer} ({', '.join(kinds)} tried): the layer read "
                  "the right rows, states and tokens and computed something else on them — a kernel, not the tree",
                  markup=False)
    sys.exit(EXIT_PASS)
