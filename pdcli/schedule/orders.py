"""A hand-written schedule (`schedule.name: file`) as text, one line per device, read into each
device's compute order for one minibatch and checked line by line (`pdcli.schedule.handwritten`
checks the devices together).

Line d (blank lines and `#` comments aside, counting from 0) is device d, which runs stage d.
It lists the compute actions of one minibatch in the order the device runs them, separated by
spaces or commas: `F<k>` / `B<k>` the forward / backward of microbatch k (0 .. M-1), `W<k>` its
deferred weight gradients (split backward: a line without W's has them placed by pd's lowering),
`U` the optimizer step (optional, and last: pd adds it). The actions' full text forms
(`F3@v0`, `U#0/4`, `pdcli.schedule.actions`) read the same. pd repeats the line for every
minibatch and adds the loads, sends, receives and optimizer steps (`pdcli.schedule.lower`).
"""

from __future__ import annotations

import re
from typing import Sequence, Union

from pdcli.errors import UserError
from pdcli.schedule.actions import Backward, Forward, OptimizerStep, WeightGrads, action_text, parse_action

ComputeAction = Union[Forward, Backward, WeightGrads]
Order = tuple[ComputeAction, ...]
"""One device's compute actions for one minibatch (microbatches 0 .. M-1, weight version 0)."""
LINE_HINT = ("a line lists one minibatch's F<k>, B<k> (each microbatch k = 0..M-1 once), optionally "
             "W<k> and a last U, e.g. `F0 F1 B0 F2 B1 F3 B2 B3` (docs/schedules.md, hand-written schedules)")
_SHORT = re.compile(r"^([FBW])(\d+)$")


def device_lines(text: str) -> list[str]:
    """The lines of a schedule file that hold actions, comments (`#` to the end) removed."""
    return [line for line in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if line]


def tokens_of(line: str) -> list[str]:
    """The actions of one line as written."""
    return [token for token in re.split(r"[\s,]+", line.strip()) if token]


def short_text(action: ComputeAction) -> str:
    """`F3`, `B3`, `W3`: an action as a line writes it."""
    return action_text(action).split("@")[0]


def where(source: str, device: int, position: int, token: str) -> str:
    """How a problem names its place: `my.txt: device 1, action 5 (B2)` (position 1-based)."""
    return f"{source}: device {device}, action {position} ({token})"


def read_orders(lines: Sequence[str], num_microbatches: int, split_backward: bool, source: str) -> tuple[Order, ...]:
    """Each device's compute order from its line; UserError naming `source`, the device, the
    action and what is wrong with the first problem found."""
    if not lines:
        raise UserError(f"{source}: no device lines", hint=LINE_HINT)
    return tuple(_read_line(tokens_of(line), device, num_microbatches, split_backward, source)
                 for device, line in enumerate(lines))


def _parse(token: str, num_microbatches: int) -> ComputeAction | OptimizerStep:
    """The action `token` writes; ValueError saying why it is not one a line may hold."""
    short = _SHORT.match(token)
    if token == "U":
        return OptimizerStep(0, num_microbatches)
    if short:
        kind, mb = short.group(1), int(short.group(2))
        action: object = Forward(mb, 0) if kind == "F" else Backward(mb, 0) if kind == "B" else WeightGrads(mb)
    else:
        try:
            action = parse_action(token)
        except ValueError:
            raise ValueError("not an action") from None
    if isinstance(action, OptimizerStep):
        if (action.step, action.num_microbatches) != (0, num_microbatches):
            raise ValueError(f"a line's optimizer step is U (or U#0/{num_microbatches}): pd numbers the steps")
        return action
    if not isinstance(action, (Forward, Backward, WeightGrads)):
        raise ValueError(f"pd adds loads, sends, receives, stashes and all-reduces itself; "
                         f"a line holds F, B, W and U only")
    if isinstance(action, (Forward, Backward)) and action.weight_version != 0:
        raise ValueError(f"weight version {action.weight_version}: a line is one minibatch's order and pd "
                         f"numbers the versions; write {short_text(action)}")
    if not 0 <= action.microbatch_id < num_microbatches:
        raise ValueError(f"microbatch {action.microbatch_id} is out of range: schedule.num_microbatches="
                         f"{num_microbatches} numbers them 0..{num_microbatches - 1}")
    return action


def _read_line(tokens: Sequence[str], device: int, num_microbatches: int, split_backward: bool,
               source: str) -> Order:
    """One device's order: every microbatch's F and B once, B after F, W (if any) once after
    each B in microbatch order, U (if any) last."""
    seen: dict[tuple[type, int], int] = {}  # (kind, microbatch) -> position
    waiting: set[int] = set()  # backwarded, W to come
    step_at: int | None = None
    order: list[ComputeAction] = []
    for position, token in enumerate(tokens, 1):
        here = where(source, device, position, token)
        try:
            action = _parse(token, num_microbatches)
        except ValueError as e:
            raise UserError(f"{here}: {e}", hint=LINE_HINT) from None
        if step_at is not None:
            if isinstance(action, OptimizerStep):
                raise UserError(f"{here}: a second optimizer step (the first is action {step_at})", hint=LINE_HINT)
            raise UserError(f"{where(source, device, step_at, 'U')}: the optimizer step comes before {token} "
                            f"(action {position}); it must follow every F, B and W of the minibatch",
                            hint="put U last or leave it out (pd adds it)")
        if isinstance(action, OptimizerStep):
            step_at = position
            continue
        mb, kind = action.microbatch_id, type(action)
        if (kind, mb) in seen:
            raise UserError(f"{here}: a second {token} (the first is action {seen[kind, mb]}); each runs once",
                            hint=LINE_HINT)
        if isinstance(action, Backward) and (Forward, mb) not in seen:
            raise UserError(f"{here}: the backward of microbatch {mb} before its forward F{mb}", hint=LINE_HINT)
        if isinstance(action, WeightGrads):
            if not split_backward:
                raise UserError(f"{here}: W actions need a split backward, and schedule.split_backward is false",
                                hint="set schedule.split_backward=null (on for file) or remove the W actions")
            if mb not in waiting:
                raise UserError(f"{here}: the weight gradients of microbatch {mb} before its backward B{mb}",
                                hint=LINE_HINT)
            if mb != min(waiting):
                raise UserError(f"{here}: W{mb} before W{min(waiting)}, whose backward ran earlier: a device adds "
                                f"weight gradients in microbatch order (as one backward pass adds them)",
                                hint=f"move W{min(waiting)} before W{mb}")
            waiting.discard(mb)
        elif isinstance(action, Backward):
            waiting.add(mb)
        seen[kind, mb] = position
        order.append(action)
    with_w = any(isinstance(a, WeightGrads) for a in order)
    for mb in range(num_microbatches):
        for kind, letter in ((Forward, "F"), (Backward, "B"), *(((WeightGrads, "W"),) if with_w else ())):
            if (kind, mb) not in seen:
                why = ("a line with W actions has one after each B (or none: pd places them)" if kind is WeightGrads
                       else f"every device runs the forward and the backward of each microbatch "
                            f"0..{num_microbatches - 1} once")
                raise UserError(f"{source}: device {device}: no {letter}{mb}: {why}", hint=LINE_HINT)
    return tuple(order)
