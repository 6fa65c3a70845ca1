"""A long run's action list without holding it: the list of a run whose middle repeats,
computed action by action from the lists of a few short runs.

A run's list grows with its minibatches: half a million actions (100 MB, seconds to build)
per process for 10,000 minibatches. Past the pipeline's warm-up, and until its drain, the
lowering repeats itself every period of P minibatches (one minibatch; more with replicas that
take microbatches round-robin, evaluations or drain points every few minibatches): each
action of the next period is the same action with its numbers (microbatch ids, weight
versions, steps) moved on by the same amounts. So the list of a run with K periods in its
middle is, for K = 1, 2, 3, ...:

    prefix(K) + body(K, 0) + body(K, 1) + ... + body(K, K - 2) + tail(K)

where every action of each part is a base action plus K (and, in the body, the copy's index)
times a constant step per number (the prefix can move with K too: an evaluation's message ids
follow the run's length). `periodic_list` builds the lists of the same run with 1, 2, 3 and 4
periods in its middle (`ScheduleSpec` with its drain and evaluation points moved), finds the
parts from the first three, and keeps them only if they give the fourth exactly; otherwise
(and for short runs) it returns None and the caller builds the whole list. `ActionList` then
gives the run's list action by action (a `Sequence`), never holding it whole.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, overload

from pdcli.errors import UserError
from pdcli.schedule.actions import Action
from pdcli.schedule.spec import ScheduleSpec

MIN_PERIODS = 16
"""Runs with fewer periods in their middle are built whole."""
LEARNED = 4
"""Short runs built: 1..LEARNED periods in the middle (the first three fit, the last checks)."""

Step = tuple[int, ...]
"""What one period adds to each of an action's fields (0 for a field that is not a number)."""


def _fields(action: Action) -> tuple[object, ...]:
    return tuple(vars(action).values())


def _step(a: Action, b: Action) -> Step | None:
    """b - a field by field; None where they differ in kind or in a field that is not a number."""
    if type(a) is not type(b):
        return None
    out: list[int] = []
    for x, y in zip(_fields(a), _fields(b)):
        if isinstance(x, int) and isinstance(y, int) and not isinstance(x, bool):
            out.append(y - x)
        elif x == y:
            out.append(0)
        else:
            return None
    return tuple(out)


def _moved(action: Action, step: Step, times: int) -> Action:
    if not times or not any(step):
        return action
    values: list[Any] = [v + times * d if d else v for v, d in zip(_fields(action), step)]  # type: ignore[operator]
    return type(action)(*values)


@dataclass(frozen=True)
class _Part:
    base: tuple[Action, ...]
    per_period: tuple[Step, ...]
    """Added once per period of the run (K)."""
    per_copy: tuple[Step, ...] = ()
    """The body: added once per copy before this one."""

    def at(self, index: int, periods: int, copy: int = 0) -> Action:
        action = _moved(self.base[index], self.per_period[index], periods)
        return _moved(action, self.per_copy[index], copy) if self.per_copy else action

    def kept(self, keep: Callable[[Action], bool]) -> _Part:
        idx = [i for i, a in enumerate(self.base) if keep(a)]
        return _Part(tuple(self.base[i] for i in idx), tuple(self.per_period[i] for i in idx),
                     tuple(self.per_copy[i] for i in idx) if self.per_copy else ())


def _steps(a: Sequence[Action], b: Sequence[Action]) -> tuple[Step, ...] | None:
    out = []
    for x, y in zip(a, b):
        step = _step(x, y)
        if step is None:
            return None
        out.append(step)
    return tuple(out)


class ActionList(Sequence[Action]):
    """The list of a run with `periods` periods in its middle, action by action (from `start` on)."""

    def __init__(self, prefix: _Part, body: _Part, tail: _Part, periods: int, start: int = 0) -> None:
        self.prefix, self.body, self.tail, self.periods = prefix, body, tail, periods
        self.start = start
        self._whole = len(prefix.base) + (periods - 1) * len(body.base) + len(tail.base)

    def __len__(self) -> int:
        return self._whole - self.start

    def _at(self, index: int) -> Action:
        k = self.periods - 1  # the short run with one period has no copy of the body
        if index < len(self.prefix.base):
            return self.prefix.at(index, k)
        index -= len(self.prefix.base)
        size = len(self.body.base)
        if index < k * size:
            copy, i = divmod(index, size)
            return self.body.at(i, k - 1, copy)
        return self.tail.at(index - k * size, k)

    @overload
    def __getitem__(self, index: int) -> Action: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Action]: ...

    def __getitem__(self, index: int | slice) -> Action | Sequence[Action]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stop == len(self) and stride == 1:
                return ActionList(self.prefix, self.body, self.tail, self.periods, self.start + start)
            return [self[i] for i in range(start, stop, stride)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._at(self.start + index)

    def __iter__(self) -> Iterator[Action]:
        for i in range(self.start, self._whole):
            yield self._at(i)

    @property
    def kinds(self) -> frozenset[type]:
        """The action types the list holds (each part's, whatever the number of periods)."""
        return frozenset(type(a) for part in (self.prefix, self.body, self.tail) for a in part.base)

    def kept(self, keep: Callable[[Action], bool]) -> ActionList:
        """The actions for which `keep`, a test of fields no period moves (e.g. the chunk), holds."""
        out = ActionList(self.prefix.kept(keep), self.body.kept(keep), self.tail.kept(keep), self.periods)
        out.start = sum(1 for i in range(self.start) if keep(self._at(i))) if self.start else 0
        return out


def action_kinds(actions: Sequence[Action]) -> frozenset[type]:
    """The action types in `actions`."""
    return actions.kinds if isinstance(actions, ActionList) else frozenset(type(a) for a in actions)


def kept_actions(actions: Sequence[Action], keep: Callable[[Action], bool]) -> Sequence[Action]:
    """The actions of `actions` for which `keep` (a test of fields no period moves) holds."""
    return actions.kept(keep) if isinstance(actions, ActionList) else [a for a in actions if keep(a)]


PERIOD_CANDIDATES = 64
"""A set of points' period is looked for among the distances from its first point to its next ones."""


def _point_period(points: Sequence[int], low: int, high: int) -> int | None:
    """The smallest L with which `points` inside [low, high) repeat (a point p there is one
    exactly when p + L, inside too, is); 1 without points, None when nothing repeats."""
    inside = [p for p in points if low <= p < high]
    if not inside:
        return 1
    held = set(inside)
    for length in (p - inside[0] for p in inside[1:PERIOD_CANDIDATES + 1]):
        if all(p + length in held for p in inside if p + length < high) and \
                all(p - length in held for p in inside if p - length >= low):
            return length
    return None


def _period(spec: ScheduleSpec, low: int, high: int) -> int | None:
    """Minibatches after which replicas take the same microbatches again and the drain and
    evaluation points inside [low, high) repeat; None when those do not repeat."""
    m = spec.num_microbatches
    period = 1
    for r in spec.replicas:
        period = math.lcm(period, r // math.gcd(r, m))
    for points in (spec.drain_after, spec.eval_after):
        length = _point_period(points, low, high)
        if length is None:
            return None
        period = math.lcm(period, length)
    return period


def _shrunk(spec: ScheduleSpec, low: int, periods: int, length: int, kept_periods: int) -> ScheduleSpec:
    """`spec` with its middle [low, low + periods * length) cut to `kept_periods` periods."""
    cut = (periods - kept_periods) * length
    end = low + kept_periods * length

    def points(ps: Sequence[int]) -> tuple[int, ...]:
        return tuple(p for p in ps if p < end) + tuple(p - cut for p in ps if p >= low + periods * length)

    return dataclasses.replace(spec, num_steps=spec.num_steps - cut, drain_after=points(spec.drain_after),
                               eval_after=points(spec.eval_after))


def _parts(lists: Sequence[Sequence[Action]]) -> tuple[_Part, _Part, _Part] | None:
    """prefix, body and tail of the lists with 1..LEARNED periods, if they fit every one."""
    one, two, three = lists[0], lists[1], lists[2]
    size = len(two) - len(one)
    if size <= 0 or any(len(b) - len(a) != size for a, b in zip(lists, lists[1:])):
        return None
    types_one, types_two = [type(a) for a in one], [type(a) for a in two]
    same_start = next((i for i, (a, b) in enumerate(zip(types_one, types_two)) if a is not b), len(one))
    same_end = next((i for i, (a, b) in enumerate(zip(reversed(types_one), reversed(types_two))) if a is not b),
                    len(one))
    low, high = max(0, len(one) - same_end), min(same_start, len(one))
    for split in dict.fromkeys((low, high, (low + high) // 2)):
        prefix = _steps(one[:split], two[:split])
        tail = _steps(one[split:], two[split + size:])
        body = _steps(two[split:split + size], three[split:split + size])
        copy = _steps(three[split:split + size], three[split + size:split + 2 * size])
        if prefix is None or tail is None or body is None or copy is None:
            continue
        parts = (_Part(tuple(one[:split]), prefix), _Part(tuple(two[split:split + size]), body, copy),
                 _Part(tuple(one[split:]), tail))
        if all(list(ActionList(*parts, periods=p + 1)) == list(lst) for p, lst in enumerate(lists)):
            return parts
    return None


def periodic_list(spec: ScheduleSpec, build: Callable[[ScheduleSpec], Sequence[Action]]) -> ActionList | None:
    """`build(spec)` (one process's whole list) as an `ActionList`, found from `build` of the
    same run shortened to 1..LEARNED periods; None when the run is short or its middle does not
    repeat as the short runs say."""
    devices = sum(spec.replicas) * spec.virtual_stages
    # the pipeline's warm-up and drain stay out of the middle
    low = 1 + math.ceil(devices / spec.num_microbatches)
    length = _period(spec, low, spec.num_steps - low)
    if length is None:
        return None
    periods = (spec.num_steps - 2 * low) // length
    if periods < MIN_PERIODS:
        return None
    try:
        lists = [build(_shrunk(spec, low, periods, length, p)) for p in range(1, LEARNED + 1)]
    except (UserError, ValueError):  # a shortened run that is not a run
        return None
    parts = _parts(lists)
    return ActionList(*parts, periods=periods) if parts is not None else None
