"""Graph capture shared by the profiler and the compiler: one tracer, one chain order."""

from __future__ import annotations

import torch
import torch.fx as fx

from pdcli.errors import UserError

# Chain positions are the nodes that compute; placeholders are model inputs, get_attr nodes
# are weights read by their consumer's stage, and the output node only names the result.
COMPUTE_OPS = ("call_module", "call_function", "call_method")


def trace_model(model: torch.nn.Module) -> fx.GraphModule:
    """Trace `model` with torch.fx at the granularity of leaf modules and functional ops.

    Both the profiler and the compiler call this, so a plan's node names (fx node names)
    mean the same graph in both. A construct fx cannot trace is a user error that names it.
    """
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError ... for untraceable code
        raise UserError(
            f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}",
            hint="avoid data-dependent Python control flow in forward(), or mark the "
            "offending submodule as a leaf (wrap it in its own nn.Module)",
        ) from None
    gm.graph.lint()
    return gm


def chain_order(gm: fx.GraphModule) -> list[fx.Node]:
    """The compute nodes of `gm` in topological (graph) order: the chain's positions."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
