"""Predicted vs measured, stage by stage, and the drift verdict with the command that re-plans.

A stage *drifts* when its measured stage time (compute + comm per minibatch) differs
from the plan's `stage_time_ms` by more than the threshold. When its compute alone is
off by more than the threshold the profile no longer describes the machine (re-profile,
then re-plan); otherwise the communication terms are off (the cluster's bandwidth in the
config), and a re-plan after fixing it is what helps. Where the plan's replay ran workers on
shared cores, compute and comm are counted in CPU time on both sides (`compute_pair`,
`comm_pair`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Sequence

from pdcli.report.measured import Measured, MeasuredStage
from pdcli.report.predicted import Predicted, PredictedStage
from pdcli.runtime.link import link_warning

DEFAULT_DRIFT_THRESHOLD_PCT = 25.0
PCT = 100.0


def relative_pct(measured: float, predicted: float) -> float | None:
    """(measured - predicted) / predicted in percent; None when nothing was predicted."""
    if predicted <= 0:
        return None
    return (measured - predicted) / predicted * PCT


def _beyond(pct: float | None, threshold_pct: float) -> bool:
    return pct is not None and abs(pct) > threshold_pct


@dataclass(frozen=True)
class StageComparison:
    stage_id: int
    predicted: PredictedStage
    measured: MeasuredStage
    stage_time_drift_pct: float | None
    compute_drift_pct: float | None
    drifted: bool


@dataclass(frozen=True)
class Drift:
    """Stages that drifted beyond the threshold and what to run."""

    stage_ids: tuple[int, ...]
    reprofile: bool
    """Compute drifted: the profile is stale or does not describe this machine."""
    command: str
    calibrate: bool = False
    """The plan priced the runtime's actions: refit them from this run (`pd plan --calibrate`)."""


@dataclass(frozen=True)
class ReplanCommands:
    """How to name the run on a `pd` command line: the recipe and its overrides."""

    recipe: str
    overrides: tuple[str, ...] = ()

    def _args(self) -> str:
        return " ".join(shlex.quote(a) for a in (self.recipe, *self.overrides))

    def train(self) -> str:
        return f"pd train {self._args()}"

    def plan(self) -> str:
        return f"pd plan {self._args()}"

    def replan(self) -> str:
        return f"pd plan {self._args()} --force && pd train {self._args()}"

    def calibrate_plan(self, run_dir: str) -> str:
        """`pd plan ... --calibrate RUN`: the re-plan from what the run in `run_dir` measured."""
        return f"{self.plan()} --calibrate {shlex.quote(run_dir)}"

    def calibrate(self, run_dir: str) -> str:
        return f"{self.calibrate_plan(run_dir)} && {self.train()}"

    def reprofile(self) -> str:
        args = self._args()
        return f"pd profile {args} --force && pd plan {args} --force && pd train {args}"


@dataclass(frozen=True)
class Comparison:
    stages: tuple[StageComparison, ...]
    predicted: Predicted
    measured: Measured
    threshold_pct: float
    drift: Drift | None
    profiled_host_speed_ms: float | None = None
    """`pdcli.host.host_speed_ms` as the profile measured it (`meta.host_speed_ms`)."""
    link_warning: str | None = None
    """`pdcli.runtime.link.link_warning` of the run's measured link; None: none, or it agrees."""

    @property
    def time_per_minibatch_ratio(self) -> float | None:
        """Measured / predicted time per minibatch (steady state when the trace has it)."""
        measured = self.measured.steady_time_per_minibatch_ms or self.measured.time_per_minibatch_ms
        p = self.predicted.time_per_minibatch_ms
        return measured / p if p > 0 else None

    @property
    def host_speed_ratio(self) -> float | None:
        """How much longer the host's reference matmul took after the run than when profiled
        (> 1: the host was slower for the run; None: one of them was not measured)."""
        run, profiled = self.measured.host_speed_ms, self.profiled_host_speed_ms
        return run / profiled if run and profiled else None


def compute_pair(p: PredictedStage, m: MeasuredStage, shared_cores: bool) -> tuple[float, float]:
    """(measured, predicted) compute of a stage, ms per minibatch: wall time, or, where the
    replay shared cores among the ranks, the CPU time of the compute actions on both sides (an
    action's wall time then depends on which worker the kernel runs, which the replay's queue
    only approximates; its CPU time is the stage's own work)."""
    if shared_cores and m.compute_cpu_ms is not None and p.compute_cpu_ms is not None:
        return m.compute_cpu_ms, p.compute_cpu_ms
    return m.compute_ms, p.compute_ms


def comm_pair(p: PredictedStage, m: MeasuredStage, shared_cores: bool) -> tuple[float, float]:
    """(measured, predicted) comm of a stage, ms per minibatch, as `compute_pair` counts compute:
    wall time, or CPU time where the replay shared cores among the ranks (a send's wall time then
    also holds the turns of the workers the kernel ran during it)."""
    if shared_cores and m.comm_cpu_ms is not None and p.comm_cpu_ms is not None:
        return m.comm_cpu_ms, p.comm_cpu_ms
    return m.comm_ms, p.comm_ms


def compare(predicted: Predicted, measured: Measured, threshold_pct: float, commands: ReplanCommands,
            calibrate_from: str | None = None, profiled_host_speed_ms: float | None = None,
            run_dir: str | None = None) -> Comparison:
    """Pair the stages of the plan with the measured ones and decide whether the plan drifted;
    `calibrate_from`: the run directory a drift is calibrated from (plans with runtime costs);
    `profiled_host_speed_ms`: the host's speed when the profile was measured; `run_dir`: the
    run's directory, named in the link warning's `--calibrate` (the link measured between
    hosts, when it is more than 2x off the configured one)."""
    if len(predicted.stages) != len(measured.stages):
        raise ValueError(f"the plan has {len(predicted.stages)} stages, the run measured {len(measured.stages)}")
    rows = []
    for p, m in zip(predicted.stages, measured.stages):
        measured_compute, predicted_compute = compute_pair(p, m, predicted.shared_cores)
        measured_comm, predicted_comm = comm_pair(p, m, predicted.shared_cores)
        stage_pct = relative_pct(measured_compute + measured_comm, predicted_compute + predicted_comm)
        compute_pct = relative_pct(measured_compute, predicted_compute)
        rows.append(StageComparison(p.stage_id, p, m, stage_pct, compute_pct, _beyond(stage_pct, threshold_pct)))
    warning = None
    if measured.link is not None and run_dir is not None:
        warning = link_warning(measured.link, commands.calibrate_plan(run_dir))
    return Comparison(tuple(rows), predicted, measured, threshold_pct, _drift(rows, threshold_pct, commands, calibrate_from),
                      profiled_host_speed_ms, warning)


def _drift(rows: Sequence[StageComparison], threshold_pct: float, commands: ReplanCommands,
           calibrate_from: str | None = None) -> Drift | None:
    drifted = tuple(r.stage_id for r in rows if r.drifted)
    if not drifted:
        return None
    if calibrate_from is not None:
        return Drift(drifted, False, commands.calibrate(calibrate_from), calibrate=True)
    reprofile = any(_beyond(r.compute_drift_pct, threshold_pct) for r in rows if r.drifted)
    return Drift(drifted, reprofile, commands.reprofile() if reprofile else commands.replan())
