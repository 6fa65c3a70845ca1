"""Virtual stages in the runtime: one worker (device) runs several chunks of the model.

Each chunk is a stage module of its own with its own `Executor` (its module, messages, weight
versions, optimizer); the worker's list (`pdcli.schedule`, chunked) names each microbatch
action's chunk, and `ChunkRunner` hands the action to that chunk's executor. An optimizer step
(and an evaluation's end) is the device's: every chunk steps, one optimizer per chunk, in chunk
order; as each parameter's update depends on its own gradient only, that is the single-process
optimizer's step (clipping by the global norm sums the squares of all the device's chunks first). A message between two chunks of the device never reaches the transport
(`Mailbox`: kept in the process until its receive takes it).
"""

from __future__ import annotations

from typing import Any, Sequence

from pdcli import schedule as S
from pdcli.runtime.executor import ActionLoop, Executor, RecvPlan
from pdcli.runtime.weights import WeightVersions

SUMMED_MEMORY_KEYS = ("weights_bytes", "optimizer_state_bytes", "stashed_weights_bytes", "activations_bytes", "peak_bytes")
"""Memory fields a device reports as the sum over its chunks (each chunk's own peak: an upper bound)."""


def chunk_actions(actions: Sequence[S.Action], chunk: int) -> Sequence[S.Action]:
    """The part of a device's list one chunk's executor sees (its own actions and the device's)."""
    return S.kept_actions(actions, lambda a: getattr(a, "chunk", None) in (None, chunk))


class ChunkRunner(ActionLoop):
    """Runs a device's list over its chunks' executors (`executors`: chunk -> Executor)."""

    def __init__(self, executors: dict[int, Executor], actions: Sequence[S.Action]) -> None:
        self.executors = executors
        super().__init__(executors[min(executors)].ctx, actions)

    # the device's counters are its chunks' (equal: they step together)
    @property  # type: ignore[override]
    def steps_done(self) -> int:
        return self.executors[min(self.executors)].steps_done

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        for executor in self.executors.values():
            executor.steps_done = value

    @property
    def weights(self) -> WeightVersions:
        """The first chunk's weight versions (every chunk holds the same version numbers)."""
        return self.executors[min(self.executors)].weights

    def set_version(self, version: int) -> None:
        for executor in self.executors.values():
            executor.weights.version = version

    @property
    def last_lr(self) -> float | None:
        return self.executors[min(self.executors)].last_lr

    @property
    def last_grad_norm(self) -> float | None:
        return self._grad_norm

    _grad_norm: float | None = None

    def optimizer_step(self, a: S.OptimizerStep) -> None:
        """Every chunk steps; clipping by the global norm counts all the device's chunks in one
        sum (one all-reduce per device, as a stage without chunks does)."""
        executors = list(self.executors.values())
        for executor in executors:
            executor.mean_grads(a)
        rule = executors[0].ctx.update_rule
        if rule is not None and rule.clip_grad_norm is not None:
            grads = [p.grad for e in executors for p in e.weights.live.values() if p.grad is not None]
            self._grad_norm = rule.clip(grads)
        for executor in executors:
            executor.apply_step(a, clip=False)

    def run_action(self, action: S.Action) -> None:
        chunk = getattr(action, "chunk", None)
        if isinstance(action, S.OptimizerStep):
            self.optimizer_step(action)
        elif chunk is None:  # the device's: every chunk ends the evaluation (stashes) in chunk order
            for executor in self.executors.values():
                S.dispatch(executor.handlers, action)
        else:
            S.dispatch(self.executors[chunk].handlers, action)

    def recv_plan(self, action: Any) -> RecvPlan:
        return self.executors[action.chunk].recv_plan(action)

    def finish(self) -> None:
        total: dict[str, Any] = {}
        for executor in self.executors.values():
            report = executor.memory.report(executor.ctx.optimizer, executor.weights.peak_stashed_bytes,
                                            executor.ctx.device)
            for key, value in report.items():
                total[key] = total.get(key, 0) + value if key in SUMMED_MEMORY_KEYS else value
        self.ctx.timeline.stats.memory = total
