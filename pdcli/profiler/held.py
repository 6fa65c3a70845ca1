"""What a stage keeps for its backward, attributed to positions so that any range adds up.

`time_node` measures each position alone, so a tensor two neighbours save (a ReLU's output
is the next Linear's input) counts for both. The runtime counts a stage's memory by
storage (`pdcli.runtime.memory`): its inputs, plus every tensor autograd saves, once. This
module runs the whole model once with a saved-tensors hook and attributes every saved
storage to one position, so that for a stage [a, b)

    held(a, b) = sum(held[a:b]) + stage input bytes + head[a] - tail[b - 1] (+ loss, last stage)

- `held[j]`: storages saved by anyone that position j produced (its outputs), plus the
  storages first saved at j that no position produced (temporaries inside a module, a
  mixed-precision weight copy); a model input is never a position's: stage 0 counts it as
  its input, as every stage counts the cut it receives;
- `tail[j]`: of `held[j]`, what only later positions save (a Flatten's output that the next
  Linear saves): a stage that ends at j sends it rather than keeps it;
- `head[j]`: what a stage starting at j adds when j is an in-place op (a `ReLU(inplace=True)`
  after the cut): the compiled stage clones its input first, and keeps both;
- `loss`: what the loss saves beyond the last position's output (its own result, the target).

The same run under bf16 autocast measures the mixed-precision figures: half-width saved
tensors, the half-width weight copies (`copies[j]`, which a split backward's WeightGrads
no longer needs), the half-width cuts, and whether each position casts fp32 inputs
(`casts[j]`): a stage receives fp32 tensors (the compiled wires' dtype), and a first op
that autocasts keeps a half-width cast of them besides.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from pdcli.profiler.replay import call_node, is_inplace, node_inputs
from pdcli.profiler.sizes import cut_bytes, iter_tensors, producer_positions, storage_bytes, storage_key
from pdcli.torchutil.wgrad import deferrable_layers

LOSS_POSITION = -2
"""Saver id of the loss (after the last position)."""


class _Attributing(fx.Interpreter):
    """Runs the graph, noting which position saves each storage first."""

    def __init__(self, gm: fx.GraphModule, positions: dict[fx.Node, int], skip: set[tuple[str, int]]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.positions, self.skip = positions, skip
        self.current = -1
        self.first_saver: dict[tuple[str, int], int] = {}
        self.nbytes: dict[tuple[str, int], int] = {}
        self.copies: set[tuple[str, int]] = set()

    def run_node(self, n: fx.Node) -> Any:
        self.current = self.positions.get(n, self.current)
        return super().run_node(n)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in self.skip:
            return t
        self.first_saver.setdefault(key, self.current)
        self.nbytes[key] = storage_bytes(t)
        if _is_weight_copy(t):
            self.copies.add(key)
        return t


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A tensor cast from a parameter (autocast's half-width weight), possibly through
    views of the cast (a Linear saves the copy transposed)."""
    fn, cast = t.grad_fn, False
    for _ in range(4):
        if fn is None:
            return False
        cast = cast or type(fn).__name__ == "ToCopyBackward0"
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
        if isinstance(getattr(fn, "variable", None), torch.nn.Parameter):
            return cast
    return False


def attribute(gm: fx.GraphModule, order: Sequence[fx.Node], inputs: Sequence[torch.Tensor],
              target: torch.Tensor, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
              half: bool) -> dict[str, Any]:
    """One forward (and the loss) of `gm` on `inputs`, fp32 or under bf16 autocast:
    `held`, `tail`, `copies` per position, `loss`, and under autocast `cut` (the half-width
    bytes crossing each cut; the fp32 ones are the chain's `cut_bytes`)."""
    positions = producer_positions(order, gm.graph)
    skip = {storage_key(t) for t in (*gm.parameters(), *gm.buffers())}
    run = _Attributing(gm, positions, skip)
    device_type = inputs[0].device.type if inputs else "cpu"
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=half)
    with torch.enable_grad(), autocast, torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
        out = run.run(*inputs)
        run.current = LOSS_POSITION
        loss_fn(out, target)
    producer: dict[tuple[str, int], int] = {}
    for node, pos in positions.items():  # earliest producer: an in-place op's output is its input
        for t in iter_tensors(run.env.get(node)):
            producer.setdefault(storage_key(t), pos)
    n = len(order)
    held, tail, copies = [0] * n, [0] * n, [0] * n
    loss = 0
    for key, first in run.first_saver.items():
        nbytes, made_by = run.nbytes[key], producer.get(key)
        if made_by is not None and made_by < 0:
            continue  # a model input: stage 0's input
        owner = made_by if made_by is not None else first
        if owner == LOSS_POSITION:
            loss += nbytes
            continue
        held[owner] += nbytes
        if key in run.copies:
            copies[owner] += nbytes
        if made_by is not None and first > made_by:  # (the loss, saving the last output, is in the last stage)
            tail[owner] += nbytes
    head = [0] * n  # a stage starting at an in-place op clones what it receives (pdcli.compiler.split)
    for pos, node in enumerate(order):
        for t in iter_tensors(run.env.get(node)) if is_inplace(gm, node) else ():
            if storage_key(t) in run.first_saver:
                head[pos] += run.nbytes[storage_key(t)]
    return {"held": held, "tail": tail, "copies": copies, "loss": loss, "head": head,
            "waiting": _waiting(gm, order, run.env, held, half),
            **({"cut": list(cut_bytes(order, gm.graph, run.env))} if half else {})}  # fp32's: the chain's cut_bytes


def _waiting(gm: fx.GraphModule, order: Sequence[fx.Node], env: dict[fx.Node, Any], held: list[int],
             half: bool) -> list[int]:
    """Per position, what a split backward keeps from a microbatch's Backward to its
    WeightGrads (`pdcli.torchutil.wgrad`): an `nn.Linear`'s input (as its matmul sees it: a
    half-width cast of an fp32 input under autocast) and its output's gradient; for a module
    whose Linear layers are inside it, everything it saved (an upper bound); 0 elsewhere."""
    out, seen = [0] * len(order), set()
    for pos, node in enumerate(order):
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        layers = deferrable_layers(module) if module is not None else []
        if not layers:
            continue
        if layers != [module]:
            out[pos] = held[pos]
            continue
        x, y = env.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None, env[node]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            out[pos] = held[pos]
            continue
        if half and x.dtype == torch.float32:
            out[pos] += x.numel() * 2
        elif storage_key(x) not in seen:
            seen.add(storage_key(x))
            out[pos] += storage_bytes(x)
        out[pos] += y.numel() * y.element_size()
    return out


def held_memory(gm: fx.GraphModule, order: Sequence[fx.Node], inputs: Sequence[torch.Tensor],
                target: torch.Tensor, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """`meta.held_memory` of a profile: the fp32 attribution, and under bf16 autocast where
    the device runs it (`half` absent otherwise)."""
    out: dict[str, Any] = {"fp32": attribute(gm, order, inputs, target, loss_fn, half=False)}
    try:
        out["half"] = attribute(gm, order, inputs, target, loss_fn, half=True)
        out["half"]["start"] = _fp32_start(out["fp32"], out["half"], _casts_input(gm, order, inputs))
    except RuntimeError as exc:  # an op without a bf16 kernel on this device
        out["half_unavailable"] = str(exc).splitlines()[0][:200]
    return out


def _fp32_start(fp32: dict[str, Any], half: dict[str, Any], casts: list[bool]) -> list[int]:
    """Per position a > 0, what a stage starting at a holds beyond the half pass's figures: it
    receives fp32 tensors (the compiled wires' dtype). A first op that autocasts keeps a
    half-width cast of them; otherwise the ops up to the first one that autocasts (c) run in
    fp32, keeping fp32 tensors, and c keeps the cast of its input instead of c - 1's
    half-width output (a stage that ends before c is counted as if it reached it)."""
    n = len(casts)
    out = [0] * n
    for a in range(1, n):
        c = next((j for j in range(a, n) if casts[j]), n)
        if c == a:
            out[a] = half["cut"][a - 1]
            continue
        extra = sum(fp32["held"][j] - half["held"][j] for j in range(a, c)) + fp32["head"][a] - half["head"][a]
        if c < n:
            extra += half["cut"][c - 1] - fp32["tail"][c - 1]
        out[a] = extra
    return out


def _casts_input(gm: fx.GraphModule, order: Sequence[fx.Node], inputs: Sequence[torch.Tensor]) -> list[bool]:
    """Per position, whether autocast runs it at half width on fp32 inputs (a Linear, a
    convolution: it casts its input, as the first op of a stage does with the fp32 tensors
    it receives; a ReLU or a pooling runs in fp32 on them)."""
    run = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        run.run(*inputs)
    device_type = inputs[0].device.type if inputs else "cpu"
    casts = []
    for node in order:
        args, kwargs = node_inputs(node, run.env, is_inplace(gm, node))
        with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16):
            value = call_node(gm, node, args, kwargs)
        casts.append(any(t.dtype == torch.bfloat16 for t in iter_tensors(value)))
    return casts
