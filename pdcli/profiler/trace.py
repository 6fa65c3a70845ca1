"""Graph capture shared by the profiler and the compiler: one tracer, one chain order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pdcli.errors import UserError
from pdcli.markers import pipe_split, recording_pipe_splits
from pdcli.models.loss import logits_of
from pdcli.profiler.chain import PIPE_SPLITS_META

# Chain positions are the nodes that compute; placeholders are model inputs, get_attr nodes
# are weights read by their consumer's stage, and the output node only names the result.
COMPUTE_OPS = ("call_module", "call_function", "call_method")


def trace_model(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor] | None = None) -> fx.GraphModule:
    """Trace `model` with torch.fx at the granularity of leaf modules and functional ops.

    Where fx cannot trace (e.g. Python control flow on shapes), torch.export traces it for
    `example_inputs` at ATen-op granularity, shapes fixed to those inputs. A tuple or dict output
    (a `transformers` ModelOutput) is cut down to its logits (`logits_of`). Both the profiler
    and the compiler call this with the same inputs, so a plan's node names mean the same
    graph in both. When both fail, the user error names both failing constructs.

    Each `pipe_split()` the forward calls is taken out of the graph and recorded as the chain
    position it cuts before (`pipe_split_positions`).
    """
    try:
        gm = _fx_trace(model)
        _keep_logits(gm, logits_of)
    except Exception as fx_error:  # fx raises TraceError, TypeError, RuntimeError ... for untraceable code
        if example_inputs is None:
            raise _untraceable(model, fx_error, None) from None
        markers: list[None] = []
        try:
            with recording_pipe_splits(lambda: markers.append(None)):
                gm = _export(model, example_inputs)
        except Exception as export_error:
            raise _untraceable(model, fx_error, export_error) from None
        if markers:
            raise UserError(
                f"{type(model).__name__} calls pipe_split() but only torch.export could trace it, which keeps "
                f"no markers (torch.fx: {_first_line(fx_error)}); make its forward traceable by torch.fx, or "
                f"cut with plan.split_points instead"
            ) from None
    gm.graph.lint()
    return gm


def _fx_trace(model: torch.nn.Module) -> fx.GraphModule:
    """`fx.symbolic_trace(model)` with each `pipe_split()` call traced as a marker node; the
    markers are then replaced by the positions they cut before (`PIPE_SPLITS_META`)."""
    tracer = fx.Tracer()
    with recording_pipe_splits(lambda: tracer.create_proxy("call_function", pipe_split, (), {})):
        graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    positions, computed = [], 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is pipe_split:
            positions.append(computed)
            gm.graph.erase_node(node)
        elif node.op in COMPUTE_OPS:
            computed += 1
    gm.recompile()
    gm.meta[PIPE_SPLITS_META] = positions
    return gm


def pipe_split_positions(gm: fx.GraphModule) -> list[int]:
    """Chain positions where the traced model's `pipe_split()` calls cut (a stage starts there)."""
    return list(gm.meta.get(PIPE_SPLITS_META, []))


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module whose forward made `node` (`layer2.0.conv1`: the
    module a call_module node calls; `` for the model's own forward)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])  # (path, type) of the innermost module, fx and torch.export alike


def _export(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    exported = torch.export.export(model, tuple(example_inputs), strict=False).module()
    assert isinstance(exported, fx.GraphModule)
    # The input-shape guard is not a layer: drop it (the runtime's shapes are fixed anyway).
    for node in list(exported.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn") and not node.users:
            exported.graph.erase_node(node)
    # A plain GraphModule over the same graph and weights: the exported module refuses
    # .train()/.eval(), which the profiler and the compiler's verification need, and wraps
    # inputs and outputs in pytrees; ours take tensors and return the one output tensor.
    # The output is flattened to its tensor leaves (None entries of a ModelOutput drop out);
    # the output spec tells which leaf holds the logits.
    out_spec = exported._out_spec
    graph = exported.graph
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(exported, graph)
    leaf = logits_of(pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec))
    _keep_logits(gm, lambda result: result[leaf] if isinstance(leaf, int) else result)
    return gm


def _keep_logits(gm: fx.GraphModule, pick: Callable[[Any], Any]) -> None:
    """Make `gm` return `pick(its output)` (the logits of a tuple or dict output) and nothing else."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = pick(output.args[0])
    if result is not output.args[0]:
        output.args = (result,)
    gm.recompile()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _untraceable(model: torch.nn.Module, fx_error: BaseException, export_error: BaseException | None) -> UserError:
    name = type(model).__name__
    message = f"torch.fx cannot trace {name}: {_first_line(fx_error)}"
    if export_error is not None:
        message += f"; torch.export cannot either: {_first_line(export_error)}"
    return UserError(
        message,
        hint="avoid data-dependent Python control flow in forward() (control flow on shapes is "
        "fine for torch.export), or wrap the offending code in a submodule of its own",
    )


def chain_order(gm: fx.GraphModule) -> list[fx.Node]:
    """The compute nodes of `gm` in topological (graph) order: the chain's positions."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
