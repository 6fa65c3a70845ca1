"""The actions of a schedule: what one process does next, as typed data.

An action list (`pdcli.schedule.lower`) is a sequence of these; the runtime's executor runs
one with a table `{ActionType: handler}` (`dispatch`), the checker and the simulator replay
the same lists. The semantics of each action is its docstring (see `pdcli.schedule.spec` for
the words: microbatch ids, weight versions).

Each action has a compact text form (`action_text`, read back by `parse_action`), used by
tests and heartbeats: `L3` load microbatch 3, `F3@v1` / `B3@v1` its forward / backward on
weight version 1, `W3` its deferred weight gradients, `SA3->r0` / `RA3<-r1` send / receive
its activations to / from replica 0 / 1 of the next / previous stage, `SG3->r0` / `RG3<-r0`
the same for gradients, `SW@v2` / `FW@v2` stash / free version 2, `AR#4` all-reduce for
step 4, `U#4/8` optimizer step 4 over 8 microbatches, `E3:e1` evaluation forward of held-out
microbatch 1 under id 3, `EE#10` end of the evaluation after 10 minibatches.

With virtual stages (`ScheduleSpec.virtual_stages`) a device runs several chunks of the model,
and its microbatch actions name theirs (`chunk`, None on a device with one): `:c<chunk>` after
the microbatch id, `F3:c2@v0` the forward of microbatch 3 through chunk 2, `SA3:c2->r0` its
activations sent on to chunk 3, `RG3:c2<-r0` the gradient received from chunk 3.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar, Union

@dataclass(frozen=True)
class LoadMicrobatch:
    """inputs (first stage) / target (last stage) = data[microbatch_id]."""

    microbatch_id: int
    chunk: int | None = None


@dataclass(frozen=True)
class RecvActivations:
    """acts_in[mb] = recv from (stage - 1, peer_replica); pairs with its SendActivations."""

    microbatch_id: int
    peer_replica: int
    chunk: int | None = None


@dataclass(frozen=True)
class Forward:
    """acts_out[mb] = stage(acts_in[mb]; weights[weight_version]); last stage: loss[mb]."""

    microbatch_id: int
    weight_version: int
    chunk: int | None = None


@dataclass(frozen=True)
class SendActivations:
    """send acts_out[mb] to (stage + 1, peer_replica); pairs with its RecvActivations."""

    microbatch_id: int
    peer_replica: int
    chunk: int | None = None


@dataclass(frozen=True)
class RecvGrads:
    """grads_out[mb] = recv from (stage + 1, peer_replica); pairs with its SendGrads."""

    microbatch_id: int
    peer_replica: int
    chunk: int | None = None


@dataclass(frozen=True)
class Backward:
    """live.grad += d loss[mb] / d weights[weight_version]; grads_in[mb]; free acts of mb."""

    microbatch_id: int
    weight_version: int
    chunk: int | None = None


@dataclass(frozen=True)
class SendGrads:
    """send grads_in[mb] to (stage - 1, peer_replica); pairs with its RecvGrads."""

    microbatch_id: int
    peer_replica: int
    chunk: int | None = None


@dataclass(frozen=True)
class WeightGrads:
    """live.grad += the weight gradients Backward(mb) deferred (split_backward); free them."""

    microbatch_id: int
    chunk: int | None = None


@dataclass(frozen=True)
class StashWeights:
    """stash[version] = copy(live weights); the live weights are at `version` right now."""

    version: int


@dataclass(frozen=True)
class FreeWeights:
    """del stash[version] (its last Forward/Backward is done)."""

    version: int


@dataclass(frozen=True)
class AllReduceGrads:
    """live.grad = sum of live.grad over this stage's replicas (collective, all replicas)."""

    step: int


@dataclass(frozen=True)
class OptimizerStep:
    """live.grad /= num_microbatches; optimizer.step(); zero grads; version = step + 1."""

    step: int
    num_microbatches: int


@dataclass(frozen=True)
class EvalForward:
    """acts_out[mb] = stage(acts_in[mb] or held-out data[eval_microbatch]; live weights), no grad; last: eval sums += loss."""

    microbatch_id: int
    eval_microbatch: int
    chunk: int | None = None


@dataclass(frozen=True)
class EndEval:
    """last stage: report the eval sums (summed over its replicas) as the evaluation after `after_minibatches`; reset."""

    after_minibatches: int


Action = Union[
    LoadMicrobatch, RecvActivations, Forward, SendActivations, RecvGrads, Backward,
    SendGrads, WeightGrads, StashWeights, FreeWeights, AllReduceGrads, OptimizerStep,
    EvalForward, EndEval,
]
Message = Union[SendActivations, RecvActivations, SendGrads, RecvGrads]
"""The actions that talk to a neighbouring stage."""
ACTION_TYPES: tuple[type, ...] = (
    LoadMicrobatch, RecvActivations, Forward, SendActivations, RecvGrads, Backward,
    SendGrads, WeightGrads, StashWeights, FreeWeights, AllReduceGrads, OptimizerStep,
    EvalForward, EndEval,
)


class UnknownActionError(TypeError):
    """An action whose type the interpreter's handler table does not know (a bug)."""


R = TypeVar("R")


def dispatch(handlers: Mapping[type, Callable[[Action], R]], action: Action) -> R:
    """Run the handler of `type(action)`; an action type without a handler is an error."""
    handler = handlers.get(type(action))
    if handler is None:
        known = ", ".join(sorted(t.__name__ for t in handlers))
        raise UnknownActionError(f"no handler for {action!r} (handlers: {known})")
    return handler(action)


_TEXT_FORMS: dict[type, str] = {
    LoadMicrobatch: "L{microbatch_id}",
    RecvActivations: "RA{microbatch_id}<-r{peer_replica}",
    Forward: "F{microbatch_id}@v{weight_version}",
    SendActivations: "SA{microbatch_id}->r{peer_replica}",
    RecvGrads: "RG{microbatch_id}<-r{peer_replica}",
    Backward: "B{microbatch_id}@v{weight_version}",
    SendGrads: "SG{microbatch_id}->r{peer_replica}",
    WeightGrads: "W{microbatch_id}",
    StashWeights: "SW@v{version}",
    FreeWeights: "FW@v{version}",
    AllReduceGrads: "AR#{step}",
    OptimizerStep: "U#{step}/{num_microbatches}",
    EvalForward: "E{microbatch_id}:e{eval_microbatch}",
    EndEval: "EE#{after_minibatches}",
}
"""The text form of each action type: its fields, in a fixed frame."""
_CHUNK_FORMS: dict[type, str] = {
    kind: re.sub(r"^(\D+\{microbatch_id\})", r"\1:c{chunk}", form)
    for kind, form in _TEXT_FORMS.items() if "chunk" in {f.name for f in dataclasses.fields(kind)}
}
"""The text form of an action that names its chunk (virtual stages: a device holds several):
`:c<chunk>` after the microbatch, `F3:c2@v0`, `SA3:c2->r0`, `W3:c2`."""
_PATTERNS = [(re.compile("^" + re.sub(r"\\{(\w+)\\}", r"(?P<\1>\\d+)", re.escape(form)) + "$"), kind)
             for forms in (_TEXT_FORMS, _CHUNK_FORMS) for kind, form in forms.items()]


PEER_WAITS: tuple[type, ...] = (RecvActivations, RecvGrads, AllReduceGrads)
"""Actions that wait for another rank."""


def waits_for_peer(text: str) -> bool:
    """Whether the action whose text form is `text` waits for another rank (False for text
    that is not an action)."""
    try:
        return isinstance(parse_action(text), PEER_WAITS)
    except ValueError:
        return False


def action_text(action: Action) -> str:
    """The compact text form of `action` (see the module docstring)."""
    fields = vars(action)
    if fields.get("chunk") is not None:
        return _CHUNK_FORMS[type(action)].format_map(fields)
    return _TEXT_FORMS[type(action)].format_map(fields)  # as cheap as repr: the executor calls it per action


def parse_action(text: str) -> Action:
    """The action whose text form is `text`; ValueError names what does not parse."""
    for pattern, kind in _PATTERNS:
        match = pattern.match(text.strip())
        if match:
            action: Action = kind(**{k: int(v) for k, v in match.groupdict().items()})
            return action
    raise ValueError(f"{text!r} is not an action (forms: {', '.join(_TEXT_FORMS.values())})")
