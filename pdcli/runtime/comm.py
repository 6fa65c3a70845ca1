"""Point-to-point transport of a stage's tensors: one flat message per (microbatch, peer).

The manifest fixes every tensor's name, shape and dtype, so sender and receiver agree on
a byte layout (`MessageLayout`) without exchanging shapes at run time. All tensors a stage
sends to one peer for one microbatch travel as ONE flat uint8 buffer: a gloo message has
a fixed cost whatever its size, so one message beats one per tensor.

`Transport` is the seam for a faster same-host transport later (shared memory, sockets):
the executor only calls `isend`, `irecv` and `Pending.wait`.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

# Tags tell apart messages between the same two ranks (gloo matches on them; NCCL relies on
# posting order, which the schedule keeps consistent on both sides).
TAG_KINDS = {"activation": 0, "gradient": 1}
TAG_STRIDE = 1 << 20
MAX_LINKS = 512
"""Links a tag can tell apart (`chunk_link`): the tags stay below 2**31 (torch's int tags)."""


def message_tag(kind: str, microbatch_id: int, link: int = 0) -> int:
    """Tag of the `kind` message of `microbatch_id` over `link` (0 without virtual stages, see
    `chunk_link`); unique per (kind, microbatch, link)."""
    return TAG_KINDS[kind] + len(TAG_KINDS) * (microbatch_id % TAG_STRIDE + TAG_STRIDE * link)


def tag_kind(tag: int) -> str | None:
    """The kind `message_tag` put into `tag`; None for a number it never makes."""
    if not 0 <= tag < len(TAG_KINDS) * TAG_STRIDE * MAX_LINKS:
        return None
    return next(kind for kind, index in TAG_KINDS.items() if index == tag % len(TAG_KINDS))


def chunk_link(producer: int, consumer: int, num_chunks: int) -> int:
    """The link between two chunks (virtual stages: one device may send another several chunks'
    messages of one microbatch); 0 without virtual stages (`num_chunks` = 0)."""
    if not num_chunks:
        return 0
    link = producer * num_chunks + consumer + 1
    if link >= MAX_LINKS:
        raise ValueError(f"{num_chunks} chunks are more than message tags can tell apart")
    return link


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a message: its manifest name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def from_manifest(entry: dict) -> "TensorSpec":
        dtype = entry["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"tensor {entry['name']!r}: unsupported dtype {dtype!r} (known: {', '.join(DTYPES)})")
        return TensorSpec(entry["name"], tuple(int(d) for d in entry["shape"]), DTYPES[dtype])


@dataclass(frozen=True)
class MessageLayout:
    """Byte layout of one message: specs sorted by name, packed back to back."""

    specs: tuple[TensorSpec, ...]

    @staticmethod
    def of(specs: Sequence[TensorSpec]) -> "MessageLayout":
        # Sorted by name: sender (outputs order) and receiver (inputs order) may list them differently.
        return MessageLayout(tuple(sorted(specs, key=lambda s: s.name)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each spec's bytes start in the message."""
        return tuple(itertools.accumulate((s.num_bytes for s in self.specs[:-1]), initial=0))

    @functools.cached_property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.specs)

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.num_bytes, dtype=torch.uint8, device=device)

    def _part(self, flat: Tensor, index: int) -> Tensor:
        """The bytes of spec `index` in `flat` (all of it for a one-tensor message)."""
        if len(self.specs) == 1:
            return flat
        offset = self.offsets[index]
        return flat[offset : offset + self.specs[index].num_bytes]

    def pack(self, tensors: dict[str, Tensor], device: torch.device) -> Tensor:
        """One flat uint8 buffer holding `tensors[name]` for every spec (cast to the spec dtype).

        Each tensor is copied (and cast, and moved) in one `copy_` into its place, seen with
        the spec's dtype and shape: a message is sent right after a matmul has left the
        caches cold, where every tensor operation costs several microseconds."""
        flat = self.empty(device)
        for index, spec in enumerate(self.specs):
            t = tensors[spec.name].detach()
            if t.shape != spec.shape:
                raise ValueError(f"tensor {spec.name!r}: shape {tuple(t.shape)} != manifest shape {spec.shape}")
            part = self._part(flat, index)
            if self.offsets[index] % spec.dtype.itemsize == 0:
                part.view(spec.dtype).view(spec.shape).copy_(t)
            else:  # a dtype view needs an aligned start (mixed dtypes in one message)
                part.copy_(t.to(device=device, dtype=spec.dtype).contiguous().view(-1).view(torch.uint8))
        return flat

    def unpack(self, flat: Tensor) -> dict[str, Tensor]:
        """Views into `flat`, one per spec, with the manifest shape and dtype."""
        out: dict[str, Tensor] = {}
        for index, spec in enumerate(self.specs):
            raw = self._part(flat, index)
            if self.offsets[index] % spec.dtype.itemsize:
                raw = raw.clone()  # a dtype view needs an aligned start (mixed dtypes in one message)
            out[spec.name] = raw.view(spec.dtype).view(spec.shape)
        return out


class Pending(Protocol):
    """A posted send or receive."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """Asynchronous point-to-point messages between ranks."""

    stream_ordered: bool
    """True when messages complete in posting order on one stream (NCCL), so both ends must
    post them in the same order; False when a send never waits for the peer (sockets, gloo)."""

    def isend(self, buf: Tensor, dst_rank: int, tag: int) -> Pending: ...

    def irecv(self, buf: Tensor, src_rank: int, tag: int) -> Pending: ...


class TorchDistTransport:
    """`torch.distributed` isend/irecv on the default group: gloo on CPU, NCCL on CUDA."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.stream_ordered = dist.get_backend(group) == "nccl"

    def isend(self, buf: Tensor, dst_rank: int, tag: int) -> Pending:
        return dist.isend(buf, dst=dst_rank, group=self.group, tag=tag)

    def irecv(self, buf: Tensor, src_rank: int, tag: int) -> Pending:
        return dist.irecv(buf, src=src_rank, group=self.group, tag=tag)


def spin_until(done: Callable[[], bool], budget_s: float) -> None:
    """Poll `done` for up to `budget_s`, yielding the core and the GIL between polls.

    A worker that blocks in the kernel for a message lets its CPU go idle, and on a virtual
    machine an idle vCPU can take milliseconds to run again; polling first keeps it awake.
    Polling costs a core only while nothing else is runnable on it, so it is for workers
    that have a core each."""
    if budget_s <= 0 or done():
        return
    deadline_s = time.perf_counter() + budget_s
    while not done() and time.perf_counter() < deadline_s:
        time.sleep(0)


@dataclass
class PostedRecv:
    """A receive posted ahead: its buffer fills in the background."""

    buf: Tensor
    work: Pending
    layout: MessageLayout


class Mailbox:
    """Posted receives keyed by (kind, microbatch, peer rank, link) and in-flight sends.

    Receives are posted ahead of the action that consumes them; sends are fire-and-forget
    (the buffer is kept alive until the send completes). A message to this process's own rank
    (`rank`: virtual stages, two chunks of one device) never reaches the transport: it is packed
    as for the wire (the same copy, casts and shape checks) and kept until its receive takes it.
    """

    def __init__(self, transport: Transport, device: torch.device, spin_wait_s: float = 0.0,
                 rank: int | None = None) -> None:
        self.transport = transport
        self.device = device
        self.spin_wait_s = spin_wait_s
        """How long a receive polls (yielding the core) before it blocks (`spin_until`)."""
        self.rank = rank
        """This process's rank (None: it never sends to itself)."""
        self.recvs: dict[tuple[str, int, int, int], PostedRecv] = {}
        self.sends: list[tuple[Tensor, Pending]] = []
        self.local: dict[tuple[str, int, int], Tensor] = {}
        """(kind, microbatch, link) -> a message to this rank, packed, until taken."""

    def post_recv(self, kind: str, microbatch_id: int, src_rank: int, layout: MessageLayout, link: int = 0) -> None:
        key = (kind, microbatch_id, src_rank, link)
        if key in self.recvs or src_rank == self.rank:
            return
        buf = layout.empty(self.device)
        work = self.transport.irecv(buf, src_rank, message_tag(kind, microbatch_id, link))
        self.recvs[key] = PostedRecv(buf, work, layout)

    def take(self, kind: str, microbatch_id: int, src_rank: int, layout: MessageLayout,
             link: int = 0) -> dict[str, Tensor]:
        """Wait for the message (posting it now if it was not posted ahead) and unpack it."""
        if src_rank == self.rank:
            return layout.unpack(self.local.pop((kind, microbatch_id, link)))
        self.post_recv(kind, microbatch_id, src_rank, layout, link)
        posted = self.recvs.pop((kind, microbatch_id, src_rank, link))
        spin_until(posted.work.is_completed, self.spin_wait_s)
        posted.work.wait()
        return posted.layout.unpack(posted.buf)

    def send(self, kind: str, microbatch_id: int, dst_rank: int, layout: MessageLayout, tensors: dict[str, Tensor],
             link: int = 0) -> None:
        flat = layout.pack(tensors, self.device)
        if dst_rank == self.rank:
            self.local[kind, microbatch_id, link] = flat
            return
        work = self.transport.isend(flat, dst_rank, message_tag(kind, microbatch_id, link))
        self.sends.append((flat, work))
        self.sends = [(b, w) for b, w in self.sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every send still in flight (end of training, before a checkpoint)."""
        for _, work in self.sends:
            work.wait()
        self.sends = []
