"""Check a hand-written schedule (`schedule.name: file`) before it runs: each line by itself
(`pdcli.schedule.orders`), then the lists pd lowers from the lines, run together by the
checker (`pdcli.schedule.checker.check_schedules`): no deadlock between the devices' orders,
whether sends complete at once (sockets, gloo) or only with their receive (NCCL). A problem
reads in the file's terms: the device (line), the action's 1-based position, the reason.
"""

from __future__ import annotations

from typing import Sequence

from pdcli.errors import UserError
from pdcli.schedule.actions import (
    Action, Backward, Forward, RecvActivations, RecvGrads, SendActivations, SendGrads,
)
from pdcli.schedule.checker import Deadlock, ScheduleError, SendMode, check_schedules
from pdcli.schedule.lower import build_all
from pdcli.schedule.orders import Order, read_orders, short_text, where
from pdcli.schedule.spec import FILE, ScheduleSpec

CHECKED_MINIBATCHES = 2
"""Minibatches of the lowered lists the check runs: every minibatch repeats the first, and the
second shows the joint between two."""
DEADLOCK_HINT = ("reorder so that every message is sent before its receiver needs it: device d forwards "
                 "microbatch k after device d-1 forwarded it, and backwards it after device d+1 backwarded it")


def check_lines(lines: Sequence[str], num_microbatches: int, split_backward: bool, source: str) -> tuple[Order, ...]:
    """The orders of a schedule file's device `lines` once they pass every check; UserError
    naming `source` (the file), the device, the action and the reason otherwise."""
    orders = read_orders(lines, num_microbatches, split_backward, source)
    check_orders(orders, num_microbatches, split_backward, source)
    return orders


def check_orders(orders: Sequence[Order], num_microbatches: int, split_backward: bool, source: str) -> None:
    """The devices' orders run together: their lowered lists complete with eager sends and with
    rendezvous sends; UserError in the file's terms otherwise."""
    spec = ScheduleSpec.make(FILE, len(orders), num_microbatches, CHECKED_MINIBATCHES,
                             split_backward=split_backward, orders=orders)
    for eager, mode in ((True, SendMode.EAGER), (False, SendMode.RENDEZVOUS)):
        lists = build_all(spec, eager_sends=eager)
        try:
            check_schedules(lists, spec, mode)
        except Deadlock as e:
            raise UserError(_deadlock_text(e, lists, spec, source), hint=DEADLOCK_HINT) from None
        except ScheduleError as e:  # the line checks should leave nothing else: a bug if it happens
            raise AssertionError(f"{source}: lowered lists of checked orders fail: {e}") from e


_WAITS: dict[type, tuple[type[Forward] | type[Backward], str]] = {
    RecvActivations: (Forward, "for the activations of microbatch {k} from device {before}"),
    RecvGrads: (Backward, "for the gradient of microbatch {k} from device {after}"),
    SendActivations: (Forward, "to send the activations of microbatch {k} to device {after}"),
    SendGrads: (Backward, "to send the gradient of microbatch {k} to device {before}"),
}
"""A message a device can wait at: the written action it belongs to, what it waits for."""


def _deadlock_text(e: Deadlock, lists: Sequence[Sequence[Action]], spec: ScheduleSpec, source: str) -> str:
    """`my.txt: device 0, action 2 (B0): deadlock: device 0 waits there for ...; device 1 waits at ...`."""
    first, parts = "", []
    for rank, index in e.stuck:
        action = lists[rank][index]
        assert isinstance(action, (RecvActivations, RecvGrads, SendActivations, SendGrads)), action  # one replica per stage
        kind, text = _WAITS[type(action)]
        k = action.microbatch_id % spec.num_microbatches
        written = kind(k, 0)
        position = spec.orders[rank].index(written) + 1
        waits = text.format(k=k, before=rank - 1, after=rank + 1)
        if not first:
            first = where(source, rank, position, short_text(written))
            parts.append(f"device {rank} waits there {waits}")
        else:
            parts.append(f"device {rank} waits at action {position} ({short_text(written)}) {waits}")
    rendezvous = (" (with sends that wait for their receive, as NCCL's do; pd runs a schedule on CPU and "
                  "CUDA alike)" if e.send_mode is SendMode.RENDEZVOUS else "")
    return f"{first}: deadlock: {'; '.join(parts)}: no device can move{rendezvous}"
