"""Close the loop: refit the runtime's costs from what a finished run measured (`pd plan --calibrate RUN`).

The probe (`pdcli.probe.runtime`) measures stages run alone in one process; a real
run shares the host with its peers, waits for messages and wakes up again, and a busy host
slows all of it. This module reads a run's `trace.json` and refits, on its own stages, what
the plan prices (`pdcli.planner.runtime_costs`): per action kind the probe's affine cost in
the stage's profiled time, rescaled to what the run's stages took in all (`refit`),
then each stage's own deviation from that line as a factor on its positions' times
(`refit_positions`: a region of the model that runs slower among workers sharing the host
than alone), the optimizer step with its weight-version bookkeeping, packing and unpacking messages (a
receive's unpacking: the low quantile of its durations, when the message was already
there), data loading, the interpreter's time between actions, and a replicated stage's
all-reduce (this host's measured line, `refit_allreduce`). Last, the latency of a
message is refitted so that the replay of the run's plan with all of these takes the run's
steady time per minibatch (bisection; the replay's time grows with the latency): what the
run waited beyond its compute, messages in flight and the pipeline's own order. The
bandwidth and the core count stay as probed. A run whose workers outnumber the host's
cores traced spans stretched by the workers it shared the cores with: every CPU cost is
scaled so that the replay's compute (on the shared cores, `pdcli.schedule.simulator`) over
the run's steady half equals the run's; as the stretch depends on how long the workers
wait and the reverse, the latency is fitted for each scale tried (`fit_shared`); a run
whose spans computed more than the replay can at the run's time gets the largest factor
that does not make the replay slower than the run (`SharedFit.capped`). The result is written to the planned run's
`calibration.json`; `pd plan` and `pd train` use it while the profile it was made for
stays the run's profile.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pdcli.errors import UserError
from pdcli.planner.costs import replica_allreduce_ms
from pdcli.planner.runtime_costs import Affine, ModeCosts, RuntimeCosts, steady, steady_mean, weight_mode
from pdcli.planner.runtime_fit import KINDS, StagePoints
from pdcli.planner.space import SplitSpace
from pdcli.profiler.batch_points import chain_of_run
from pdcli.profiler.chain import Chain
from pdcli.report.build import read_trained_plan
from pdcli.report.compare import ReplanCommands
from pdcli.report.measured import (
    COMPUTE, SUMMARY_FILE, TRACE_FILE, TRAIN_DIR, RankTrace, Span, evaluated_after, read_trace, steady_completions,
    steady_time_per_minibatch_ms,
)
from pdcli.report.predicted import plan_merges_weight_grads
from pdcli.runtime.metrics import action_category

MAX_LATENCY_MS = 50.0
LATENCY_BISECTIONS = 16
SHARED_FACTORS = (0.25, 4.0)
"""Shared cores: the range of the factor on the CPU costs fitted from the run's spans."""
SHARED_BISECTIONS = 8
UNPACK_QUANTILE = 0.1
"""A receive's unpacking cost where its message's send is not in the trace: this quantile of
its durations (most receives also wait)."""


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(steady(values), q)) if values else 0.0


def _spans(traces: Sequence[RankTrace], chunk: int | None = None) -> dict[str, list[Span]]:
    """Action name -> its spans on `traces`; only chunk `chunk`'s actions unless None."""
    out: dict[str, list[Span]] = {}
    for trace in traces:
        for span in trace.spans:
            if chunk is None or span.chunk == chunk:
                out.setdefault(span.name, []).append(span)
    return out


def _durations_of(spans: dict[str, list[Span]]) -> dict[str, list[float]]:
    """Action name -> the durations (ms) of its `spans`."""
    return {name: [span.dur_ms for span in by_name] for name, by_name in spans.items()}


def _durations(traces: Sequence[RankTrace], chunk: int | None = None) -> dict[str, list[float]]:
    """Action name -> durations (ms) on `traces`; only chunk `chunk`'s actions unless None."""
    return _durations_of(_spans(traces, chunk))


def _sends_ended(traces: dict[int, RankTrace], plan: dict[str, Any], chunked: bool) -> dict[tuple[str, int, int], float]:
    """(Send action, the sending stage, microbatch) -> when that send ended, on the trace's clock."""
    stage_of = {int(r): int(stage["stage_id"]) for stage in plan["stages"] for r in stage["ranks"]}
    out: dict[tuple[str, int, int], float] = {}
    for rank, trace in traces.items():
        for span in trace.spans:
            if span.name.startswith("Send") and span.microbatch is not None:
                stage = span.chunk if chunked and span.chunk is not None else stage_of.get(rank)
                if stage is not None:
                    out[(span.name, stage, span.microbatch)] = span.end_ms
    return out


def _after_arrival(spans: Sequence[Span], sent: dict[tuple[str, int, int], float], send: str, sender: int) -> list[float]:
    """How long each receive in `spans` ran after its message's send (`send` on stage `sender`)
    ended: its unpacking, without the wait for the peer. A receive whose message was sent before
    it began counts whole; one whose send is not in the trace is left out. The ranks share one
    host's clock (`pdcli.runtime.metrics.Timeline`)."""
    out = []
    for span in spans:
        ended = sent.get((send, sender, span.microbatch)) if span.microbatch is not None else None
        if ended is not None:
            out.append(min(max(span.end_ms - max(span.start_ms, ended), 0.0), span.dur_ms))
    return out


def _gaps(traces: Sequence[RankTrace]) -> list[float]:
    out: list[float] = []
    for trace in traces:
        spans = trace.spans
        out.extend(steady([max(b.start_ms - a.end_ms, 0.0) for a, b in zip(spans, spans[1:])]))
    return out


def refit(xs: Sequence[float], ys: Sequence[float], base: Affine) -> Affine:
    """`base` rescaled so that it gives the run's points their measured total. The line's
    shape (scale against fixed cost) stays the probe's, fitted through stages of 10-40% of the
    work: a line through a run's two or three stages of near-equal size would extrapolate
    wildly to other splits."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    predicted = float(np.sum(base(x))) if x.size else 0.0
    if not predicted > 0:
        return base
    factor = max(float(y.sum()), 0.0) / predicted
    return Affine(base.scale * factor, base.fixed_ms * factor)


def refit_positions(ranges: Sequence[tuple[int, int]], points: dict[str, tuple[list[float], list[float]]],
                    mode: ModeCosts, factors: Sequence[float], stage_factors: Sequence[float]) -> tuple[float, ...]:
    """`factors` (one per position) times, on each of the run's stages `ranges` (in the order
    their forward and backward points were added; `stage_factors`: each one's
    `SplitSpace.position_factor` under `factors`), the factor by which the stage's measured
    forward + backward exceeds what the refitted `mode` prices: the stage's own deviation from
    the line through all of them. The stage's actions run at its factor whole, fixed costs
    too (`runtime_action_costs`), so a plan of the run's split prices each stage as measured
    and a stage near the line gets a factor near 1 however much of its time is fixed. As the
    refit matched the stages' total, the factors average about 1 weighted by time."""
    out = list(factors)
    (xf, yf), (xb, yb) = points["forward"], points["backward"]
    if not (len(xf) == len(xb) == len(ranges) == len(stage_factors)):
        return tuple(out)
    for (start, end), x_fwd, y_fwd, x_bwd, y_bwd, r in zip(ranges, xf, yf, xb, yb, stage_factors):
        priced = (mode.forward.scale * x_fwd + mode.backward.scale * x_bwd
                  + (mode.forward.fixed_ms + mode.backward.fixed_ms) * r)
        if not (priced > 0 and y_fwd + y_bwd > 0):
            continue
        for i in range(start, end):
            out[i] *= (y_fwd + y_bwd) / priced
    return tuple(out)


def refit_allreduce(points: Sequence[tuple[float, int, float]], base: Affine | None) -> Affine | None:
    """`base` (this host's all-reduce, `RuntimeCosts.allreduce`) rescaled so that it prices the
    run's replicated stages' AllReduceGrads, (parameter bytes, replicas, measured ms) each, at
    their measured total; `base` when the run had none or nothing was measured."""
    if base is None or not points:
        return base
    predicted = sum(float(replica_allreduce_ms(p, r, float("inf"), base)) for p, r, _ in points)
    if not predicted > 0:
        return base
    factor = sum(ms for _, _, ms in points) / predicted
    return Affine(base.scale * factor, base.fixed_ms * factor)


def chain_of_plan(chain: Chain, plan: dict[str, Any]) -> Chain:
    """The profile priced as the planner priced the run of `plan`: its microbatch's rows
    (`meta.batch_points`), its precision (`meta.precision_time`) and, merged per chunk, its
    weight gradients at the minibatch's rows; so that a refit is of the costs beyond those and a
    plan of another configuration reads it alike."""
    inputs = plan["inputs"]
    batch_size = int(inputs["batch_size"])
    merged = batch_size if plan_merges_weight_grads(plan, str(inputs["schedule"])) else None
    return chain_of_run(chain, batch_size // int(inputs["num_microbatches"]), str(inputs.get("precision", "fp32")),
                        merged)


def calibrate_from_run(run_dir: Path, chain: Chain, base: RuntimeCosts) -> tuple[RuntimeCosts, dict[str, Any]]:
    """`base` refitted to the run in `run_dir` (trained from a plan of `chain`), and what was measured."""
    plan = read_trained_plan(run_dir, ReplanCommands(str(run_dir)))
    inputs = plan.get("inputs", {})
    schedule, m = str(inputs["schedule"]), int(inputs["num_microbatches"])
    precision = str(inputs.get("precision", "fp32"))
    chunks_per_rank = int(inputs.get("virtual_stages", 1))
    chunked = chunks_per_rank > 1  # the plan's stages are chunks, several per rank
    traces = read_trace(run_dir / TRAIN_DIR / TRACE_FILE)
    if not traces:
        raise UserError(f"{run_dir / TRAIN_DIR / TRACE_FILE}: no trace to calibrate from",
                        hint=f"train the run first: `pd train {run_dir / 'config.yaml'}`")
    chain = base.priced(chain_of_plan(chain, plan))
    space = SplitSpace.from_chain(chain)  # the positions' times with `base`'s factors
    if plan["stages"][-1]["end"] != space.num_positions:
        raise UserError(f"{run_dir}: its plan covers {plan['stages'][-1]['end']} positions, the profile has "
                        f"{space.num_positions}", hint="calibrate from a run trained with this profile")
    profiled = float(chain.meta.get("batch_size") or 0) or None
    per_mb = (float(inputs["batch_size"]) / m / profiled) if profiled else 1.0
    mode_name = weight_mode(schedule)
    mode = base.modes[mode_name]
    fits = StagePoints(space, per_mb, base.loss_fwd_ms, base.loss_bwd_ms)
    sends: list[tuple[float, float]] = []
    recvs: list[tuple[float, float]] = []
    n, last_id = space.num_positions, len(plan["stages"]) - 1
    load_inputs, load_target = base.load_inputs_ms, base.load_target_ms
    measured: list[dict[str, Any]] = []
    allreduces: list[tuple[float, int, float]] = []
    cut = np.asarray(chain.cut_bytes, dtype=float)
    ranks_of = [set(int(r) for r in stage["ranks"]) for stage in plan["stages"]]
    sent = _sends_ended(traces, plan, chunked)
    for stage in plan["stages"]:
        k, start, end = int(stage["stage_id"]), int(stage["start"]), int(stage["end"])
        own = [traces[r] for r in stage["ranks"] if r in traces]
        own_spans = _spans(own, k if chunked else None)
        times = _durations_of(own_spans)
        last = k == last_id
        fits.add(start, end, times, last, update=not chunked)  # a rank steps all of its chunks at once
        # a message to a chunk on the same rank does not leave the process: not a transfer's cost
        in_bytes = cut[start - 1] * per_mb if start > 0 and ranks_of[k - 1] != ranks_of[k] else 0.0
        out_bytes = cut[end - 1] * per_mb if end < n and ranks_of[k + 1] != ranks_of[k] else 0.0
        for action, nbytes in (("SendActivations", out_bytes), ("SendGrads", in_bytes)):
            if nbytes and action in times:
                sends.append((nbytes, steady_mean(times[action])))
        for action, nbytes, send, sender in (("RecvActivations", in_bytes, "SendActivations", k - 1),
                                             ("RecvGrads", out_bytes, "SendGrads", k + 1)):
            if nbytes and action in times:
                unpacked = _after_arrival(own_spans[action], sent, send, sender)
                recvs.append((nbytes, steady_mean(unpacked) if unpacked else _quantile(times[action], UNPACK_QUANTILE)))
        loads = steady(times.get("LoadMicrobatch", []))
        # a replica runs m / replicas LoadMicrobatch per minibatch; the first makes the minibatch
        load_ms = float(sum(loads)) / len(loads) * m / int(stage["replicas"]) if loads else 0.0
        if start == 0 and loads:
            load_inputs = load_ms
        elif last and loads:
            load_target = load_ms
        if int(stage["replicas"]) > 1 and "AllReduceGrads" in times:
            params = space.range_total(space.covered_parameter_bytes, start, end)
            allreduces.append((params, int(stage["replicas"]), steady_mean(times["AllReduceGrads"])))
        measured.append({"stage_id": k, "actions_ms": {a: steady_mean(v) for a, v in sorted(times.items())}})
    if chunked:
        for rank in sorted(set().union(*ranks_of)):
            if rank in traces:
                fits.add_update([(int(st["start"]), int(st["end"])) for st, held in zip(plan["stages"], ranks_of)
                                 if rank in held], _durations([traces[rank]]))
    modes = dict(base.modes)
    modes[mode_name] = ModeCosts(*(refit(*fits.points[kind], getattr(mode, kind)) for kind in KINDS))
    ranges = [(int(stage["start"]), int(stage["end"])) for stage in plan["stages"]]
    position_scale = refit_positions(ranges, fits.points, modes[mode_name], base.position_factors(n),
                                     [space.position_factor(start, end) for start, end in ranges])
    gaps = _gaps(list(traces.values()))
    gaps_mean = float(sum(gaps)) / len(gaps) if gaps else base.gap_ms
    num_ranks = len(set().union(*ranks_of))
    shared = base.shares(num_ranks)
    calibrated = replace(
        base, modes=modes, load_inputs_ms=load_inputs, load_target_ms=load_target,
        send=refit([b for b, _ in sends], [t for _, t in sends], base.send) if sends else base.send,
        recv=refit([b for b, _ in recvs], [t for _, t in recvs], base.recv) if recvs else base.recv,
        gap_ms=gaps_mean, allreduce=refit_allreduce(allreduces, base.allreduce), position_scale=position_scale,
        # a run on shared cores: its refit holds what sharing cost it
        shared_slowdown=1.0 if shared else base.shared_slowdown,
        shared_cpu_scale=1.0 if shared else base.shared_cpu_scale,
        sources={**base.sources, "calibrated_from": str(run_dir)},
    )
    target_ms = run_steady_ms(run_summary(run_dir), plan, traces)
    compute_ms = plan_compute_ms(plan, list(traces.values())) if shared else None
    shared_fit = None
    if compute_ms:  # its latency fitted to the run's time at the factor it takes
        calibrated, shared_fit = fit_shared(calibrated, chain, plan, compute_ms, target_ms)
    elif target_ms is not None:
        calibrated = fit_latency(calibrated, chain, plan, target_ms)
    return calibrated, {"run": str(run_dir), "schedule": schedule, "num_microbatches": m, "precision": precision,
                        "boundaries": [int(stage["start"]) for stage in plan["stages"][1:]],
                        "steady_time_per_minibatch_ms": target_ms, "stages": measured,
                        **({"shared_cores": shared_fit.to_json()} if shared_fit else {})}


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The `summary.json` of the run in `run_dir` ({} when it has none)."""
    path = run_dir / TRAIN_DIR / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def run_steady_ms(summary: dict[str, Any], plan: dict[str, Any], traces: dict[int, RankTrace]) -> float | None:
    """The steady time per minibatch of a run (trained from `plan`, traced as `traces`, summed
    up in `summary`): its first stage's completions (`steady_time_per_minibatch_ms`); None: too
    short."""
    first = [traces[r] for r in plan["stages"][0]["ranks"] if r in traces]
    return steady_time_per_minibatch_ms(first, per_rank(plan), evaluated_after(summary))


def per_rank(plan: dict[str, Any]) -> int:
    """The microbatches a rank of `plan` runs per minibatch (each of its chunks runs all)."""
    inputs = plan["inputs"]
    return int(inputs["num_microbatches"]) * int(inputs.get("virtual_stages", 1))


def plan_compute_ms(plan: dict[str, Any], ranks: Sequence[RankTrace]) -> float | None:
    """`steady_compute_ms` of the `ranks` (measured or replayed) of a run of `plan`."""
    first = {int(r) for r in plan["stages"][0]["ranks"]}
    return steady_compute_ms([t for t in ranks if t.rank in first], ranks, per_rank(plan))


@dataclass(frozen=True)
class RunAndReplay:
    """A run beside its plan's replay, per minibatch over the steady half: the time, and the
    compute of all ranks in CPU time (the replay's with no rank queued for a core)."""

    run_ms: float
    replay_ms: float
    run_compute_cpu_ms: float | None
    replay_compute_cpu_ms: float | None


def run_and_replay(run_dir: Path, chain: Chain, runtime: RuntimeCosts) -> RunAndReplay | None:
    """The run in `run_dir` beside its plan's replay with `runtime`'s costs (`chain` priced at
    the run's microbatch rows and precision, no `shared_slowdown` nor `shared_cpu_scale`). The
    run's compute in CPU time over its steady half is its traced compute there times the CPU
    time per compute ms its ranks' totals hold (`summary.json`). None: the run was too short to
    have a steady time."""
    plan = read_trained_plan(run_dir, ReplanCommands(str(run_dir)))
    traces = read_trace(run_dir / TRAIN_DIR / TRACE_FILE)
    summary = run_summary(run_dir)
    target_ms = run_steady_ms(summary, plan, traces) if traces else None
    if target_ms is None:
        return None
    inputs = plan["inputs"]
    priced = chain_of_plan(chain, plan)
    alone = replace(runtime, shared_slowdown=1.0, shared_cpu_scale=1.0)
    compute_ms = plan_compute_ms(plan, list(traces.values()))
    stages = summary.get("stages", ())
    wall = sum(float(s["compute_ms"]) * int(s["replicas"]) for s in stages)
    cpu = sum(float(s.get("compute_cpu_ms", 0.0)) * int(s["replicas"]) for s in stages)
    return RunAndReplay(target_ms, replayed_ms(alone, priced, plan),
                        compute_ms * cpu / wall if compute_ms and wall > 0 and cpu > 0 else None,
                        replayed_compute_ms(alone.without("cores"), priced, plan))


def steady_compute_ms(first_stage: Sequence[RankTrace], ranks: Sequence[RankTrace], num_microbatches: int) -> float | None:
    """The compute spans of all `ranks` over the steady state of the run (between the
    completions `steady_time_per_minibatch_ms` spans), per minibatch; None: too short."""
    done_ms, first, last = steady_completions(first_stage, num_microbatches)
    if last <= first:
        return None
    low, high = done_ms[first], done_ms[last]
    inside = sum(max(0.0, min(s.end_ms, high) - max(s.start_ms, low))
                 for r in ranks for s in r.spans if s.category == COMPUTE)
    return inside / (last - first)


def replayed_traces(runtime: RuntimeCosts, chain: Chain, plan: dict[str, Any]) -> list[RankTrace] | None:
    """The replay of `plan` with `runtime`'s costs as traces of its ranks (None: no action lists)."""
    from pdcli.planner.evaluate import evaluate_plan, plan_options_of, replay

    costed = runtime.priced(chain)
    if _chunked(plan):
        from pdcli.planner.virtual import replay_chunked_plan

        sim = replay_chunked_plan(costed, plan)
    else:
        priced = evaluate_plan(costed, plan)
        sim = replay(priced.stages, plan_options_of(plan), (priced.replay or {}).get("cores"))
    if sim is None:
        return None
    return [RankTrace(rank, f"rank {rank}", tuple(
        Span(type(t.action).__name__, action_category(t.action), t.start_ms, t.end_ms - t.start_ms) for t in timed))
        for rank, timed in enumerate(sim.timeline)]


@dataclass(frozen=True)
class SharedFit:
    """What `fit_shared` fitted: the factor on the CPU costs, the largest it could take (the
    replay of the run's plan with no latency as slow as the run), the compute per minibatch
    over the steady half, the run's and the replay's at the factor, and the bisection's last
    bracket, (factor, replayed compute) at either end."""

    factor: float
    max_factor: float
    run_compute_ms: float
    replayed_compute_ms: float
    bracket: tuple[tuple[float, float], tuple[float, float]]

    @property
    def capped(self) -> bool:
        """The run's spans computed more than the replay can at the run's time: at the largest
        factor allowed the replay still computes less than the run."""
        (_, _), (high, computed) = self.bracket
        return high >= self.max_factor and computed < self.run_compute_ms

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "capped": self.capped}


def fit_shared(runtime: RuntimeCosts, chain: Chain, plan: dict[str, Any], compute_ms: float,
               target_ms: float | None) -> tuple[RuntimeCosts, SharedFit | None]:
    """Workers sharing cores: `runtime`'s CPU costs times the factor with which the replay of
    `plan` (its latency fitted to `target_ms` at each factor) computes `compute_ms` per minibatch
    over its steady half; the replay's compute grows with the factor (bisection), though not
    smoothly (where the cores' queue changes order it jumps), so of every factor tried the one
    computing closest to the run is taken. Factors whose replay is slower than `target_ms` with
    no latency at all are not taken. None: the replay has no action lists to compute."""
    def at(factor: float) -> RuntimeCosts:
        scaled = runtime.cpu_scaled(factor)
        return fit_latency(scaled, chain, plan, target_ms) if target_ms is not None else scaled

    low, high = SHARED_FACTORS
    if target_ms is not None:  # the largest factor whose replay is not slower than the run
        a, b = low, high
        for _ in range(SHARED_BISECTIONS):
            mid = (a * b) ** 0.5
            a, b = (mid, b) if replayed_ms(replace(runtime.cpu_scaled(mid), latency_ms=0.0), chain, plan) < target_ms else (a, mid)
        high = a
    max_factor = high
    tried: dict[float, tuple[RuntimeCosts, float]] = {}

    def trial(factor: float) -> float | None:
        if factor not in tried:
            fitted = at(factor)
            replayed = replayed_compute_ms(fitted, chain, plan)
            if replayed is None:
                return None
            tried[factor] = (fitted, replayed)
        return tried[factor][1]

    for _ in range(SHARED_BISECTIONS):
        mid = (low * high) ** 0.5
        replayed = trial(mid)
        if replayed is None:
            return runtime, None
        low, high = (mid, high) if replayed < compute_ms else (low, mid)
    bracket = ((low, trial(low) or 0.0), (high, trial(high) or 0.0))
    factor = min(tried, key=lambda f: abs(tried[f][1] - compute_ms))
    fitted, replayed = tried[factor]
    return fitted, SharedFit(factor, max_factor, compute_ms, replayed, bracket)


def replayed_compute_ms(runtime: RuntimeCosts, chain: Chain, plan: dict[str, Any]) -> float | None:
    """`steady_compute_ms` of the replay of `plan` with `runtime`'s costs."""
    traces = replayed_traces(runtime, chain, plan)
    return plan_compute_ms(plan, traces) if traces is not None else None


def replayed_ms(runtime: RuntimeCosts, chain: Chain, plan: dict[str, Any]) -> float:
    """Time per minibatch of `plan`'s stages replayed with `runtime`'s costs."""
    if _chunked(plan):
        from pdcli.planner.virtual import replay_chunked_plan

        workers = len({int(r) for stage in plan["stages"] for r in stage["ranks"]})
        return replay_chunked_plan(runtime.priced(chain), plan).time_per_minibatch_ms * runtime.slowdown(workers)
    from pdcli.planner.evaluate import evaluate_plan

    return evaluate_plan(runtime.priced(chain), plan).time_per_minibatch_ms


def _chunked(plan: dict[str, Any]) -> bool:
    """A plan of virtual stages: its stages are chunks, several per rank."""
    return int(plan["inputs"].get("virtual_stages", 1)) > 1


def fit_latency(runtime: RuntimeCosts, chain: Chain, plan: dict[str, Any], target_ms: float) -> RuntimeCosts:
    """`runtime` with the message latency that makes the replay of `plan` take `target_ms` per
    minibatch (0 when the replay is slower already; at most MAX_LATENCY_MS)."""
    def at(latency_ms: float) -> RuntimeCosts:
        return replace(runtime, latency_ms=latency_ms,
                       bandwidth_bytes_per_s=runtime.bandwidth_bytes_per_s or float("inf"))

    low, high = 0.0, MAX_LATENCY_MS
    if replayed_ms(at(low), chain, plan) >= target_ms:
        return at(low)
    if replayed_ms(at(high), chain, plan) <= target_ms:
        return at(high)
    for _ in range(LATENCY_BISECTIONS):
        mid = (low + high) / 2
        low, high = (mid, high) if replayed_ms(at(mid), chain, plan) < target_ms else (low, mid)
    # the replay's time can jump inside the last bracket: take the end closest to the target
    return min((at(low), at(high)), key=lambda r: abs(replayed_ms(r, chain, plan) - target_ms))
