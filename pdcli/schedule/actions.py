"""The actions of a schedule: what one process does next, as typed data.

An action list (`pdcli.schedule.lower`) is a sequence of these; the runtime's executor runs
one with a table `{ActionType: handler}` (`dispatch`), the checker and the simulator replay
the same lists. The semantics of each action is its docstring (see `pdcli.schedule.spec` for
the words: microbatch ids, weight versions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar, Union

@dataclass(frozen=True)
class LoadMicrobatch:
    """inputs (first stage) / target (last stage) = data[microbatch_id]."""

    microbatch_id: int


@dataclass(frozen=True)
class RecvActivations:
    """acts_in[mb] = recv from (stage - 1, peer_replica); pairs with its SendActivations."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class Forward:
    """acts_out[mb] = stage(acts_in[mb]; weights[weight_version]); last stage: loss[mb]."""

    microbatch_id: int
    weight_version: int


@dataclass(frozen=True)
class SendActivations:
    """send acts_out[mb] to (stage + 1, peer_replica); pairs with its RecvActivations."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class RecvGrads:
    """grads_out[mb] = recv from (stage + 1, peer_replica); pairs with its SendGrads."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class Backward:
    """live.grad += d loss[mb] / d weights[weight_version]; grads_in[mb]; free acts of mb."""

    microbatch_id: int
    weight_version: int


@dataclass(frozen=True)
class SendGrads:
    """send grads_in[mb] to (stage - 1, peer_replica); pairs with its RecvGrads."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class WeightGrads:
    """live.grad += the weight gradients Backward(mb) deferred (split_backward); free them."""

    microbatch_id: int


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
