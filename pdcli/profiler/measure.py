"""Measure a model position by position: forward/backward time and the bytes the planner needs."""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence

import torch
import torch.fx as fx
from tqdm import tqdm

from pdcli.models.loss import logits_of
from pdcli.profiler.chain import HELD_META, PIPE_SPLITS_META, Chain, ChainNode
from pdcli.profiler.clock import Clock, device_name
from pdcli.profiler.held import held_memory
from pdcli.profiler.optim_cost import OptimizerCost, OptimizerFactory, measure_optimizer, step_overhead_ms
from pdcli.profiler.replay import call_node, is_inplace, node_inputs, used_parameters
from pdcli.profiler.sizes import (
    cut_bytes,
    input_bytes,
    iter_tensors,
    parameter_bytes,
    parameters_by_position,
    storage_bytes,
    storage_key,
    value_bytes,
)
from pdcli.profiler.summary import SHAPE_SEPARATOR, summarize  # noqa: F401  (the CLI imports summarize from here)
from pdcli.profiler.trace import chain_order, module_path, pipe_split_positions, trace_model
from pdcli.torchutil.wgrad import DeferredWeightGrads

CREATED_BY = "pd profile"
LABEL_MAX_CHARS = 72

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class BatchLike(Protocol):
    """What the profiler needs of a batch (`pdcli.data.Batch` is one)."""

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]: ...

    @property
    def target(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class NodeTiming:
    """Measured cost of one chain position."""

    fwd_ms: float
    bwd_ms: float
    saved_bytes: int
    """Bytes of the distinct storages its forward saved for backward (parameters excluded)."""
    wgrad_ms: float = 0.0
    """Of `bwd_ms`, the weight gradients a split backward defers (see `time_weight_grads`)."""


def profile_model(
    model: torch.nn.Module,
    batch: BatchLike,
    loss_fn: LossFn,
    device: str | torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    *,
    config_hash: str = "",
    model_name: str | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    optimizer_name: str = "",
) -> Chain:
    """Profile `model` on `batch` (in train mode, moved to `device`) as the planner's chain.

    Position i is `chain_order(trace_model(model))[i]`. Every position is run alone on its
    recorded inputs: `warmup` untimed runs, then the median of `repeats` timed forwards and
    of `repeats` timed backwards; for a module that runs `nn.Linear` layers, the part of the
    backward a split backward defers is timed on its own (`time_weight_grads`). The whole
    model's step (forward, loss, backward) is timed the same way and recorded as
    `meta.calibration`. With `optimizer_factory` (the
    configured optimizer, built as the runtime builds it) each position's optimizer step is
    timed on its own parameters (`pdcli.profiler.optim_cost`) and the fixed cost of a step
    is recorded as `meta.optimizer.step_overhead_ms`.
    """
    device = torch.device(device)
    model.to(device).train()
    inputs = tuple(t.to(device) for t in batch.inputs)
    target = batch.target.to(device)
    gm = trace_model(model, inputs)
    order = chain_order(gm)
    values = record_values(gm, inputs)
    owned = parameters_by_position(gm, order)
    always_alive = {storage_key(t) for t in (*gm.parameters(), *gm.buffers())}
    clock = Clock(device)

    nodes: list[ChainNode] = []
    bar = tqdm(total=len(order), desc="profile", unit="layer", file=sys.stderr, leave=False,
               disable=not (progress and sys.stderr.isatty()))  # fmt: skip
    with bar:
        for node, params in zip(order, owned):
            bar.set_postfix_str(node.name, refresh=False)
            timing = time_node(gm, node, values, clock, warmup, repeats, always_alive)
            optim = (measure_optimizer(params, optimizer_factory, clock, warmup, repeats)
                     if optimizer_factory is not None else OptimizerCost(0.0, 0))
            nodes.append(
                ChainNode(
                    name=node.name,
                    label=node_label(gm, node, values[node]),
                    fwd_ms=timing.fwd_ms,
                    bwd_ms=timing.bwd_ms,
                    parameter_bytes=parameter_bytes(params),
                    activation_bytes=value_bytes(values[node]),
                    backward_memory_bytes=timing.saved_bytes,
                    optimizer_ms=optim.step_ms,
                    optimizer_state_bytes=optim.state_bytes,
                    wgrad_ms=timing.wgrad_ms,
                    module=module_path(node),
                )
            )
            bar.update()

    step_ms = time_step(model, inputs, target, loss_fn, clock, warmup, repeats)
    sum_node_ms = sum(n.fwd_ms + n.bwd_ms for n in nodes)
    meta = {
        "created_by": CREATED_BY,
        "source": CREATED_BY,
        "model": model_name or type(model).__name__,
        "device": device_name(device),
        "device_type": device.type,
        "timer": "cuda_events" if clock.uses_cuda_events else "perf_counter_ns",
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "batch_size": int(inputs[0].shape[0]) if inputs and inputs[0].dim() > 0 else 1,
        "dtype": model_dtype(model, inputs),
        "config_hash": config_hash,
        "warmup": warmup,
        "repeats": repeats,
        "calibration": {
            "step_ms": step_ms,
            "sum_node_ms": sum_node_ms,
            "ratio": step_ms / sum_node_ms if sum_node_ms > 0 else None,
        },
        HELD_META: held_memory(gm, order, inputs, target, loss_fn),
    }
    if pipe_split_positions(gm):
        meta[PIPE_SPLITS_META] = pipe_split_positions(gm)
    if optimizer_factory is not None:
        meta["optimizer"] = {
            "name": optimizer_name,
            "step_overhead_ms": step_overhead_ms(optimizer_factory, clock, warmup, repeats),
            "sum_node_ms": sum(n.optimizer_ms for n in nodes),
        }
    return Chain(
        nodes=tuple(nodes),
        cut_bytes=cut_bytes(order, gm.graph, values),
        input_bytes=input_bytes(inputs),
        meta=meta,
    )


def record_values(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[fx.Node, Any]:
    """Run the whole graph once (no autograd) and keep every node's value: each position's inputs."""
    interpreter = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interpreter.run(*inputs)
    return dict(interpreter.env)


def time_node(
    gm: fx.GraphModule,
    node: fx.Node,
    values: Mapping[fx.Node, Any],
    clock: Clock,
    warmup: int,
    repeats: int,
    always_alive: set[tuple[str, int]],
) -> NodeTiming:
    """Forward and backward time of `node` run alone, and the bytes it saves for backward.

    Inputs are detached copies of the recorded values that require grad where they are
    floating point and computed by the model (model inputs do not, as in training), so the
    backward computes exactly the gradients training needs. The backward is seeded with
    ones of each output's shape; outputs without a grad_fn (integers, sizes, inputs
    passed through) have no backward. `bwd_ms` is the whole (unsplit) backward; a
    `call_module` node's weight gradients are then timed apart (`time_weight_grads`).
    """
    copy_inputs = is_inplace(gm, node)
    used_params = used_parameters(gm, node, values)

    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in always_alive:
            saved[key] = storage_bytes(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call_node(gm, node, *node_inputs(node, values, copy_inputs))
    except RuntimeError as e:
        if copy_inputs or "in-place" not in str(e):
            raise
        copy_inputs = True  # an in-place op the name checks missed: feed it non-leaf copies
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call_node(gm, node, *node_inputs(node, values, copy_inputs))

    fwd_samples: list[float] = []
    bwd_samples: list[float] = []
    for iteration in range(warmup + repeats):
        args, kwargs = node_inputs(node, values, copy_inputs)
        clock.sync()
        clock.start()
        out = call_node(gm, node, args, kwargs)
        fwd_ms = clock.stop()
        roots = [t for t in iter_tensors(out) if t.grad_fn is not None]
        bwd_ms = 0.0
        if roots:
            seeds = [torch.ones_like(t) for t in roots]
            clock.sync()
            clock.start()
            torch.autograd.backward(roots, seeds)
            bwd_ms = clock.stop()
        for p in used_params:
            p.grad = None
        if iteration >= warmup:
            fwd_samples.append(fwd_ms)
            bwd_samples.append(bwd_ms)
    bwd_ms = _median(bwd_samples)
    wgrad_ms = 0.0
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        # W is part of the backward: timed apart, a tiny layer's W can come out above its
        # whole backward by the per-call overhead, which the planner must not subtract
        wgrad_ms = min(time_weight_grads(gm, node, module, values, copy_inputs, clock, warmup, repeats), bwd_ms)
    return NodeTiming(_median(fwd_samples), bwd_ms, sum(saved.values()), wgrad_ms)


def time_weight_grads(
    gm: fx.GraphModule,
    node: fx.Node,
    module: torch.nn.Module,
    values: Mapping[fx.Node, Any],
    copy_inputs: bool,
    clock: Clock,
    warmup: int,
    repeats: int,
) -> float:
    """Median time of the WeightGrads of `node` (a call of `module`): the `g^T x` matmuls of the
    `nn.Linear` layers its forward runs, which a split backward leaves to a later action.

    As the runtime does it (`pdcli.torchutil.wgrad`): the layers are patched, each run's
    forward and backward (untimed) file their (x, g) pairs, and `apply` is timed adding into
    the gradient the runs before left (as every microbatch of a minibatch but the first). 0 when
    nothing was deferred: no Linear layer, or none reached through its forward (e.g.
    `nn.MultiheadAttention` reads its `out_proj` weight directly). Costs `warmup + repeats`
    more forward/backward runs of each such position.
    """
    deferred = DeferredWeightGrads(module)
    if not deferred.layers:
        return 0.0
    params = list(module.parameters())
    samples: list[float] = []
    deferred.install()
    try:
        for iteration in range(warmup + repeats):
            args, kwargs = node_inputs(node, values, copy_inputs)
            out = call_node(gm, node, args, kwargs)
            roots = [t for t in iter_tensors(out) if t.grad_fn is not None]
            if roots:
                with deferred.collecting(0):
                    torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            if not deferred.held(0):
                return 0.0
            clock.sync()
            clock.start()
            deferred.apply(0)  # from the second run on into the gradient the runs before left
            wgrad_ms = clock.stop()
            if iteration >= warmup:
                samples.append(wgrad_ms)
    finally:
        deferred.uninstall()
        deferred.pending.clear()
        for p in params:
            p.grad = None
    return _median(samples)


def step_samples(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    target: torch.Tensor,
    loss_fn: LossFn,
    clock: Clock,
    warmup: int,
    repeats: int,
    variants: Mapping[str, Callable[[], ContextManager[object]]],
) -> dict[str, list[float]]:
    """Each variant's times (ms) of the whole model's training step (forward, loss and backward
    inside the variant's context) over `repeats` rounds after `warmup` untimed ones; the variants
    take turns within every round."""
    params = list(model.parameters())
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for iteration in range(warmup + repeats):
        for name, context in variants.items():
            for p in params:
                p.grad = None
            clock.sync()
            clock.start()
            with context():
                loss_fn(logits_of(model(*inputs)), target).backward()
            ms = clock.stop()
            if iteration >= warmup:
                samples[name].append(ms)
    for p in params:
        p.grad = None
    return samples


def time_step(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    target: torch.Tensor,
    loss_fn: LossFn,
    clock: Clock,
    warmup: int,
    repeats: int,
) -> float:
    """Median time of the whole model's training step: forward, loss, backward."""
    return float(statistics.median(
        step_samples(model, inputs, target, loss_fn, clock, warmup, repeats, {"": contextlib.nullcontext})[""]))


def ratios_to_first(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each variant's time as a factor on the first variant's: the median of the rounds' ratios
    (`step_samples`, the variants in turn within a round), so that a change in the host's speed
    during the measurement moves both sides of a ratio alike."""
    first = samples[next(iter(samples))]
    return {name: float(statistics.median(t / max(f, 1e-12) for t, f in zip(times, first)))
            for name, times in samples.items()}


def node_label(gm: fx.GraphModule, node: fx.Node, value: Any) -> str:
    """Module path and op, and the output shape: `layer1.0.conv1: Conv2d(64, 64, ...) -> [8, 64, 32, 32]`."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        extra = module.extra_repr().replace("\n", " ")
        if len(extra) > LABEL_MAX_CHARS:
            extra = extra[: LABEL_MAX_CHARS - 3] + "..."
        op = f"{node.target}: {type(module).__name__}({extra})"
    elif node.op == "call_method":
        op = f"{node.name}: Tensor.{node.target}"
    else:
        fn_module = getattr(node.target, "__module__", None) or "torch"
        fn_name = getattr(node.target, "__name__", repr(node.target))
        op = f"{node.name}: {fn_module.replace('_operator', 'operator')}.{fn_name}"
    if isinstance(value, torch.Tensor):
        return f"{op}{SHAPE_SEPARATOR}{list(value.shape)}"
    return op


def model_dtype(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> str:
    """The dtype of the model's floating-point parameters (else of its inputs), e.g. `float32`."""
    for t in (*model.parameters(), *inputs):
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return str(torch.get_default_dtype()).removeprefix("torch.")


def _median(samples: list[float]) -> float:
    return float(statistics.median(samples)) if samples else 0.0
