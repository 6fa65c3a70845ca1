"""Virtual stages: the model cut into S x V chunks on S devices, and each chunked schedule's
compute order for one minibatch on one device (`pdcli.schedule.lower` repeats it per minibatch
and adds the messages, loads and the optimizer step).

Placement: `loop` (interleaved, loopedbfs) puts chunks d, d + S, d + 2S, ... on device d;
`v` (zbv, V = 2) puts chunks d and 2S - 1 - d on device d, so chunk S - 1 hands its output to
chunk S on the same device and device 0 holds both the first and the last chunk.

The orders (microbatches 0 .. M-1, weight version 0, every action naming its chunk):
- `interleaved`: Megatron's interleaved 1F1B. The device's k-th forward is microbatch
  (k // SV) * S + k % S of its local chunk (k // S) % V, its k-th backward the same microbatch
  of local chunk V - 1 - (k // S) % V; warm-up (S - d - 1) * 2 + (V - 1) * S forwards (all of
  them when M = S), then one forward and one backward in turn, then the remaining backwards.
  Needs M a multiple of S (groups of S microbatches cycle through the chunks).
- `loopedbfs`: breadth first: every microbatch through the first local chunk, then the next
  chunk, ...; then the backwards, the last local chunk first, each in microbatch order.
- `zbv`: the zero-bubble V schedule (Qi et al., ZB-V; the order torch.distributed.pipelining's
  ScheduleZBVZeroBubble computes): split backward, B (input gradients) and W (weight gradients)
  as separate actions, W where the device would otherwise wait.
"""

from __future__ import annotations

from typing import Union

from pdcli.schedule.actions import Backward, Forward, WeightGrads

ChunkAction = Union[Forward, Backward, WeightGrads]
LOOP, V_SHAPE = "loop", "v"
"""Chunk placements: `ScheduleRules.placement`."""


def chunks_on(placement: str, num_devices: int, virtual_stages: int, device: int) -> tuple[int, ...]:
    """The chunks `device` holds, in model order for `loop`, (d, 2S-1-d) for `v`."""
    if placement == V_SHAPE:
        return (device, 2 * num_devices - 1 - device)
    return tuple(device + j * num_devices for j in range(virtual_stages))


def device_of(placement: str, num_devices: int, chunk: int) -> int:
    """The device that holds `chunk` (the inverse of `chunks_on`)."""
    if placement == V_SHAPE and chunk >= num_devices:
        return 2 * num_devices - 1 - chunk
    return chunk % num_devices


def interleaved(num_devices: int, virtual_stages: int, num_microbatches: int, device: int) -> list[ChunkAction]:
    """Megatron's interleaved 1F1B order of `device` (M a multiple of S)."""
    s, v, m = num_devices, virtual_stages, num_microbatches
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (s * v)) * s + k % s

    def fwd(k: int) -> Forward:
        return Forward(microbatch(k), 0, device + ((k // s) % v) * s)

    def bwd(k: int) -> Backward:
        return Backward(microbatch(k), 0, device + (v - 1 - (k // s) % v) * s)

    warmup = total if m == s else min(total, (s - device - 1) * 2 + (v - 1) * s)
    order: list[ChunkAction] = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(k + warmup), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def looped_bfs(num_devices: int, virtual_stages: int, num_microbatches: int, device: int) -> list[ChunkAction]:
    """Breadth-first order of `device`: all forwards chunk by chunk, then the backwards in reverse chunk order."""
    chunks = chunks_on(LOOP, num_devices, virtual_stages, device)
    order: list[ChunkAction] = [Forward(mb, 0, c) for c in chunks for mb in range(num_microbatches)]
    return order + [Backward(mb, 0, c) for c in reversed(chunks) for mb in range(num_microbatches)]


def zbv(num_devices: int, num_microbatches: int, device: int) -> list[ChunkAction]:
    """The ZB-V order of `device` (V = 2, split backward), computed for max(2S - 1, M)
    microbatches and cut to M as torch.distributed.pipelining does."""
    s, rank = num_devices, device
    n = max(2 * s - 1, num_microbatches)
    c0, c1 = rank, 2 * s - 1 - rank
    ops: list[ChunkAction] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (s - rank) - 1):  # warm-up: the first chunk only
        ops.append(Forward(f0, 0, c0))
        f0 += 1
    for _ in range(rank):  # both chunks
        ops += [Forward(f1, 0, c1), Forward(f0, 0, c0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(s - rank):  # the second chunk's first backwards
        ops += [Forward(f1, 0, c1), Backward(b1, 0, c1), WeightGrads(b1, c1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:  # steady state
        if f0 < n:
            ops.append(Forward(f0, 0, c0))
            f0 += 1
        ops += [Backward(b0, 0, c0), WeightGrads(b0, c0), Forward(f1, 0, c1), Backward(b1, 0, c1), WeightGrads(b1, c1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):  # cool-down: input gradients first, weight gradients where it waits
        ops += [Backward(b0, 0, c0), Backward(b1, 0, c1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(s - rank):
        ops += [Backward(b0, 0, c0), WeightGrads(w0, c0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [WeightGrads(mb, c1) for mb in range(w1, b1)]
    ops += [WeightGrads(mb, c0) for mb in range(w0, b0)]
    return [a for a in ops if a.microbatch_id < num_microbatches]
