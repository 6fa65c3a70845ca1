"""The pipeline probes: real `pd train` runs of the configured schedule on this host, refitted.

`probe_pipeline` trains the stages the recipe plans (or a balanced pipeline of the cluster's
devices, at most PIPELINE_MAX_WORKERS workers) for a short run, in this process through the
steps' `RunHooks` or as a `pd train` subprocess, and refits the runtime probe's costs to it
(`pdcli.report.calibrate`): what workers sharing the host, waiting for each other and waking
up again pay that stages run alone do not. Where the layout's workers outnumber the cores,
`probe_sharing` runs one that shares them and keeps how much slower than its replay it went. A
probe run that fails after its workers started is a RunFailed naming the probe (the job's own
fault handling stopped it); one whose configuration `pd train` refuses is skipped, said why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from omegaconf import OmegaConf

from pdcli.config.loader import load_config
from pdcli.config.schema import Config
from pdcli.errors import RunFailed, UserError
from pdcli.planner.runtime_costs import RUNTIME_META, RuntimeCosts, weight_mode
from pdcli.probe.runtime import minibatches_for, profiled_ms
from pdcli.profiler.batch_points import BATCH_POINTS_META, PRECISION_META
from pdcli.profiler.chain import Chain
from pdcli.progress import current
from pdcli.report.calibrate import RunAndReplay, calibrate_from_run, run_and_replay

PIPELINE_TIMEOUT_S = 300.0
PROBE_FAILED_HINT = ("run `pd profile` again (add --force to remeasure); to go without the probe, set "
                     "profile.pipeline_probe_minibatches=0 (the plan then predicts from the stages measured alone)")
"""What a user does when a probe's training run failed (RunFailed)."""
PIPELINE_MAX_MINIBATCHES = 2000
"""The most minibatches `profile.pipeline_probe_seconds` makes a pipeline probe run."""
PIPELINE_RUN = "pipeline-probe"
PIPELINE_MAX_WORKERS = 4
"""The pipeline probe runs at most this many workers."""


Seed = Callable[[Config, Chain], None]
"""Writes a chain as the profile of the run directory a loaded config names, under that config's
inputs hash (`pdcli.steps.profile.seed_profile`), so the run reuses it."""
Train = Callable[[Path, list[str]], "subprocess.CompletedProcess[str]"]
"""Trains `pd train recipe overrides` in this process, as the command would (its workers are
processes of their own), and returns its exit status and error message as a finished process's
(`pdcli.steps.profile.train_probe`): 2 where the configuration is refused, 1 where a worker failed."""


@dataclasses.dataclass(frozen=True)
class RunHooks:
    """What the steps, which know run directories, lend the probes' training runs: `seed` gives
    each run the profile measured here; `train` runs it in this process (None: `pd train` in a
    subprocess, which pays the interpreter's and torch's start again)."""

    seed: Seed
    train: Train | None = None


def balanced_cuts(chain: Chain, num_stages: int) -> list[int]:
    """Where `num_stages` stages of `chain` start (1..) to share its profiled forward + backward evenly."""
    work = np.cumsum([node.fwd_ms + node.bwd_ms for node in chain.nodes])
    n, cuts = len(chain.nodes), []
    for k in range(1, num_stages):
        cut = int(np.searchsorted(work, work[-1] * k / num_stages)) + 1
        cuts.append(min(max(cut, (cuts[-1] + 1) if cuts else 1), n - (num_stages - k)))
    return cuts


StageLayout = Sequence[tuple[int, int, int]]
"""A plan's stages as (start, end, replicas)."""


def pipeline_layout(cfg: Config, chain: Chain, layout: StageLayout | None) -> tuple[list[int], list[int]] | None:
    """(cuts, replicas per worker's stage) of the pipeline probe: `layout` when it is a pipeline
    of at most PIPELINE_MAX_WORKERS workers (the stages the recipe plans, so that the probe runs
    the workers and the split the run will), else as many stages as the cluster has devices (at
    most PIPELINE_MAX_WORKERS, one replica each) with a balanced split. With virtual stages
    (`schedule.virtual_stages` = V) the stages are chunks, V per worker: the cuts are the
    chunks', the replicas one per worker. None: nothing to probe (the layout is one worker; one
    device or one position per chunk)."""
    v = int(cfg.schedule.virtual_stages)
    workers = sum(r for _, _, r in layout) // v if layout else 0
    if layout is not None and workers == 1:
        return None
    if layout is not None and len(layout) >= 2 * v and workers <= PIPELINE_MAX_WORKERS:
        replicas = [r for _, _, r in layout]
        return [start for start, _, _ in layout[1:]], (replicas if v == 1 else [1] * workers)
    return balanced_layout(cfg, chain, cfg.num_devices)


def balanced_layout(cfg: Config, chain: Chain, workers: int) -> tuple[list[int], list[int]] | None:
    """(cuts, replicas) of a pipeline of `workers` workers (at most PIPELINE_MAX_WORKERS, one
    replica each, V chunks each with virtual stages) whose stages share the profiled work
    evenly. None: fewer than 2 workers or positions per chunk."""
    v = int(cfg.schedule.virtual_stages)
    num_stages = min(workers, len(chain.nodes) // v, PIPELINE_MAX_WORKERS)
    return (balanced_cuts(chain, num_stages * v), [1] * num_stages) if num_stages >= 2 else None


def probe_layouts(cfg: Config, chain: Chain, planned: tuple[list[int], list[int]],
                  cores: int) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]] | None]:
    """(the layout the pipeline probe fits the costs on, the layout that measures
    `shared_slowdown` or None). The costs come from a run whose workers each have a core:
    `planned` (`pipeline_layout`) when it fits the `cores`, else the balanced pipeline over the
    cores, and `planned`, which shares them, measures the slowdown (its own plan is then priced
    from a run of itself). When `planned` fits the cores, the devices' balanced pipeline
    measures it if that shares them. With fewer than 2 cores `planned` is fitted as it is."""
    if sum(planned[1]) <= cores:
        devices = balanced_layout(cfg, chain, cfg.num_devices)
        return planned, (devices if devices is not None and sum(devices[1]) > cores else None)
    dedicated = balanced_layout(cfg, chain, cores)
    return (dedicated, planned) if dedicated is not None else (planned, None)


def probe_pipeline(cfg: Config, chain: Chain, runtime: RuntimeCosts, minibatches: int,
                   layout_of: Callable[[Chain], StageLayout | None] | None = None,
                   hooks: RunHooks | None = None) -> RuntimeCosts:
    """`runtime` refitted from a short real run of the configured schedule on this host, laid
    out by `pipeline_layout` from `layout_of(chain priced with runtime)` (the stages the recipe
    plans; one worker per replica), at least `minibatches` minibatches and
    enough for `profile.pipeline_probe_seconds` in the measured half by the profiled time; what
    workers sharing the host, waiting for each other and waking up again pay that stages run
    alone do not (`pdcli.report.calibrate`). Where that layout's workers outnumber the cores,
    the costs are fitted on the balanced pipeline over the cores and the planned layout measures
    `shared_slowdown` (`probe_layouts`). It trains `profile.pipeline_probe_runs` times and
    keeps the refit of the run with the median steady time: how fast a run goes moves from one
    run to the next on a shared host, and one run's level would price every plan; it stops
    early where two runs agree within `profile.pipeline_probe_agree` (`agreed`).
    `sources["pipeline_probe"]` says what ran, or why nothing did (fewer than 2 devices or
    workers, not the CPU, fewer than 2 positions, or every run failed: then the costs are
    unchanged); `sources["pipeline_runs_ms"]` holds each run's steady time per minibatch. A
    layout that shares the cores, where there is one, runs after it (`probe_sharing`). `hooks`
    give each run `chain` as its profile and train it in this process (`RunHooks`)."""
    costed = runtime.priced(chain)
    planned = pipeline_layout(cfg, chain, layout_of(costed) if layout_of is not None else None)
    if planned is None or runtime.cores is None:
        return _noted(runtime, "skipped: needs 2 CPU devices, 2 workers and 2 positions")
    (cuts, replicas), shared = probe_layouts(cfg, chain, planned, runtime.cores)
    workers = sum(replicas)
    overrides = _probe_overrides(cfg, costed, cuts, replicas, minibatches)
    fitted: list[tuple[float, RuntimeCosts, dict[str, Any]]] = []
    failures: list[str] = []
    most = max(1, int(cfg.profile.pipeline_probe_runs))
    steps = _probe_minibatches(cfg, costed, workers, minibatches)
    with current().phase(f"profile: pipeline probe ({steps} minibatches of {cfg.schedule.name} on {workers} workers)",
                         total=most) as phase:
        for _ in range(most):
            outcome = _pipeline_run(cfg, costed, runtime, overrides, hooks)
            phase.advance()
            if isinstance(outcome, str):
                failures.append(outcome)
            else:
                fitted.append(outcome)
            if agreed([ms for ms, _, _ in fitted], cfg.profile.pipeline_probe_agree):
                break
    if not fitted:
        return _noted(runtime, f"skipped: the probe run failed ({failures[0]})")
    fitted.sort(key=lambda run: run[0])
    _, calibrated, measured = fitted[(len(fitted) - 1) // 2]  # the median run (the lower of two)
    runs_ms = [round(ms, 4) for ms, _, _ in fitted]
    calibrated = dataclasses.replace(calibrated, sources={**runtime.sources, "pipeline": measured,
                                                          "pipeline_runs_ms": runs_ms})
    shown = f" x replicas {replicas}" if _replicated(replicas) else ""
    runs = f"; the median of {len(fitted)} runs ({', '.join(f'{ms:.2f}' for ms in runs_ms)} ms per minibatch)" \
        if len(fitted) > 1 else ""
    calibrated = _noted(calibrated, f"{steps} minibatches of "
                                    f"{cfg.schedule.name} on {workers} workers, split at {cuts}{shown}{runs}")
    return probe_sharing(cfg, costed, calibrated, shared, minibatches, hooks) if shared is not None else calibrated


def agreed(runs_ms: Sequence[float], within: float) -> bool:
    """Two of the runs' steady times per minibatch are within `within` (relative) of each
    other: the host's run-to-run spread is small enough that another run would not move the
    median (`profile.pipeline_probe_agree`; 0: never, every run trains)."""
    ordered = sorted(ms for ms in runs_ms if math.isfinite(ms) and ms > 0)
    return within > 0 and any(b - a <= within * a for a, b in zip(ordered, ordered[1:]))


def _replicated(replicas: Sequence[int]) -> bool:
    """Some stage of the layout has more than one replica."""
    return any(r > 1 for r in replicas)


def probe_sharing(cfg: Config, costed: Chain, calibrated: RuntimeCosts, shape: tuple[list[int], list[int]],
                  minibatches: int, hooks: RunHooks | None = None) -> RuntimeCosts:
    """`calibrated` (fitted on workers with a core each) with `shared_slowdown` and
    `shared_cpu_scale`: short real runs of the layout `shape` (more workers than cores), the
    median of at most `profile.pipeline_probe_runs` (fewer where two agree, `agreed`), over their replay with `calibrated`'s costs: in
    time, and in their compute's CPU time. What the replay's core queue does not model (context
    switches, the transport's threads waking up on busy cores, caches and memory bandwidth
    shared) is in the one; what of it the compute itself pays, in the other.
    `sources["shared_probe"]` says what ran, or why it failed (then the costs are unchanged)."""
    cuts, replicas = shape
    workers = sum(replicas)
    overrides = _probe_overrides(cfg, costed, cuts, replicas, minibatches)
    runs: list[RunAndReplay] = []
    failure = ""
    most = max(1, int(cfg.profile.pipeline_probe_runs))
    with current().phase(f"profile: shared-cores probe ({workers} workers on {calibrated.cores} cores)",
                         total=most) as phase:
        for _ in range(most):
            with _probe_dir("pd-shared-probe-") as tmp:
                proc = _train(cfg, tmp, overrides, costed, hooks)
                phase.advance()
                refused = _check_run(proc, "shared-cores")
                if refused is not None:
                    failure = refused
                    continue
                measured = run_and_replay(tmp / PIPELINE_RUN, costed, calibrated)
            if measured is not None:
                runs.append(measured)
            if agreed([run.run_ms / run.replay_ms for run in runs], cfg.profile.pipeline_probe_agree):
                break
    if not runs:
        return dataclasses.replace(calibrated, sources={**calibrated.sources, "shared_probe":
                                                        f"skipped: the run failed ({failure or 'too short'})"})
    slowdowns = [run.run_ms / run.replay_ms for run in runs]
    cpu_scales = [run.run_compute_cpu_ms / run.replay_compute_cpu_ms for run in runs
                  if run.run_compute_cpu_ms and run.replay_compute_cpu_ms]
    cpu_scale = statistics.median(cpu_scales) if cpu_scales else 1.0
    how = (f"{_probe_minibatches(cfg, costed, workers, minibatches)} minibatches of {cfg.schedule.name} on "
           f"{workers} workers sharing {calibrated.cores} cores, split at {cuts}: "
           f"{', '.join(f'{x:.2f}' for x in slowdowns)} x the replay"
           + (f", the compute {', '.join(f'{x:.2f}' for x in cpu_scales)} x its CPU time" if cpu_scales else "")
           + ", the median taken")
    return dataclasses.replace(
        calibrated, shared_slowdown=statistics.median(slowdowns), shared_cpu_scale=cpu_scale,
        sources={**calibrated.sources, "shared_probe": how,
                 "shared_runs_ms": [[round(run.run_ms, 4), round(run.replay_ms, 4)] for run in runs],
                 "shared_compute_cpu_ms": [[round(run.run_compute_cpu_ms or 0.0, 4),
                                            round(run.replay_compute_cpu_ms or 0.0, 4)] for run in runs]})


def _probe_minibatches(cfg: Config, chain: Chain, workers: int, minibatches: int) -> int:
    """How many minibatches a pipeline probe of `workers` workers trains: at least `minibatches`
    and enough for `profile.pipeline_probe_seconds` in the measured half at `pipeline_minibatch_ms`."""
    return minibatches_for(cfg.profile.pipeline_probe_seconds, pipeline_minibatch_ms(cfg, chain, workers), minibatches,
                           PIPELINE_MAX_MINIBATCHES)


def pipeline_minibatch_ms(cfg: Config, chain: Chain, workers: int) -> float:
    """About how long a minibatch of a pipeline of `workers` workers takes: the whole model's
    minibatch as the in-process probe ran it (the sum of its stages' walls in the schedule's
    weight mode, fixed costs and all; `chain.meta.runtime`) over the workers that compute at
    once (at most the cores); the profiled forward + backward where the chain has no probe."""
    runtime = RuntimeCosts.from_meta(chain.meta)
    stages = runtime.sources.get("stages", []) if runtime is not None else []
    walls = [float(st["minibatch_ms"]) for st in stages
             if st.get("mode") == weight_mode(cfg.schedule.name) and st.get("minibatch_ms")]
    parallel = max(1, min(workers, runtime.cores or workers) if runtime is not None else workers)
    if walls:
        return sum(walls) / parallel
    profiled = chain.meta.get("batch_size") if isinstance(chain.meta, dict) else None
    return profiled_ms(chain, 0, len(chain.nodes)) * (cfg.data.batch_size / profiled if profiled else 1.0) / parallel


def _probe_overrides(cfg: Config, chain: Chain, cuts: Sequence[int], replicas: Sequence[int],
                     minibatches: int) -> list[str]:
    """`pd train` overrides for a pipeline probe run of the stages split at `cuts` with
    `replicas`, one worker per replica, the configured schedule."""
    workers = sum(replicas)
    bandwidth = cfg.cluster.levels[0].bandwidth_bytes_per_s
    steps = _probe_minibatches(cfg, chain, workers, minibatches)
    return [
        "profile.runtime_probe=false", "profile.repeats=1",
        "profile.warmup=1", f"train.steps={steps}", "train.epochs=null", f"train.log_every={steps}",
        "train.eval_batches=0", "train.eval_every=0", "train.eval_at_start=false", "train.tensorboard=false",
        "train.checkpoint_every=0", "train.init_from=null", f"plan.num_stages={len(replicas)}",
        f"plan.replicas=[{','.join(map(str, replicas))}]" if _replicated(replicas) else "plan.replicas=null",
        "plan.split_points=null", "plan.pipe_splits=false", f"plan.boundaries=[{','.join(map(str, cuts))}]",
        f"cluster.levels=[{{devices: {workers}, bandwidth_bytes_per_s: {bandwidth}}}]",
        f"schedule.name={cfg.schedule.name}", f"schedule.virtual_stages={cfg.schedule.virtual_stages}",
        # the stand-in configuration the stages were probed with, not a search of its own
        # (whose pick, e.g. bf16 or other microbatches, the refit would read as this one)
        "plan.search=[]",
    ]


def _train(cfg: Config, tmp: Path, overrides: list[str], chain: Chain,
           hooks: RunHooks | None = None) -> subprocess.CompletedProcess[str]:
    """`pd train` of `cfg` with `overrides` as run PIPELINE_RUN under `tmp`, `hooks` giving it
    `chain` as its profile (`seed_run`) and training it in this process (else a subprocess,
    stopped after PIPELINE_TIMEOUT_S)."""
    recipe = tmp / "config.yaml"
    recipe.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    items = [f"run.root={tmp}", f"run.name={PIPELINE_RUN}", *overrides]
    if hooks is not None:
        seed_run(recipe, items, chain, hooks.seed)
    # From the user's directory, as their own run: relative data paths and `model.target`
    # modules beside the recipe resolve there (run.root keeps every file in tmp).
    if hooks is not None and hooks.train is not None:  # a hung worker is the job's watchdog's (train.timeout_s)
        return hooks.train(recipe, items)
    try:
        return subprocess.run([sys.executable, "-c", "from pdcli.cli import main; main()", "train", str(recipe), *items],
                              capture_output=True, text=True, timeout=PIPELINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # killed; its workers follow their launcher (die_with_parent)
        raise RunFailed(f"a probe's training run did not finish within {PIPELINE_TIMEOUT_S:g} s",
                        hint=PROBE_FAILED_HINT) from None


def seed_run(recipe: Path, overrides: list[str], chain: Chain, seed: Seed) -> None:
    """`seed` the run of `pd train recipe overrides` with `chain` as its profile, without what
    the probe's overrides switch off (the runtime's costs, other microbatch sizes, other
    precisions): measured again, with fewer repeats, the model would be what that run plans
    with, at the cost of building and timing it in every probe run. Where the overrides do not
    load, nothing is written: the run reports why it fails."""
    try:
        cfg = load_config(recipe, overrides).config
    except UserError:
        return
    meta = {k: v for k, v in chain.meta.items() if k not in (RUNTIME_META, BATCH_POINTS_META, PRECISION_META)}
    seed(cfg, dataclasses.replace(chain, meta=meta))


def _why(proc: subprocess.CompletedProcess[str]) -> str:
    """A failed probe run's reason: the last lines of its stderr."""
    return " | ".join(line.strip() for line in proc.stderr.splitlines()[-3:])


@contextlib.contextmanager
def _probe_dir(prefix: str) -> Iterator[Path]:
    """A temporary run directory for a probe's training run, removed after it unless the run
    failed (RunFailed): its worker logs, which the message names, stay for the user to read."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    except RunFailed:
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


def _check_run(proc: subprocess.CompletedProcess[str], probe: str) -> str | None:
    """None when the probe's run succeeded; why, when `pd train` refused its configuration (exit
    2: the probe goes without it, as before any worker started). A run that started and failed
    (a worker died or hung: `pd train` stopped the job under its own fault handling, exit 1) is
    RunFailed: a fault of this host is not a figure to plan with."""
    if proc.returncode == 0:
        return None
    if proc.returncode == 2:
        return _why(proc)
    raise RunFailed(f"the {probe} probe's training run failed (exit {proc.returncode}): {_why(proc)}",
                    hint=PROBE_FAILED_HINT)


def _pipeline_run(cfg: Config, costed: Chain, runtime: RuntimeCosts, overrides: list[str],
                  hooks: RunHooks | None = None) -> tuple[float, RuntimeCosts, dict[str, Any]] | str:
    """One run of the pipeline probe (`pd train` with `overrides`) refitted: (its steady time
    per minibatch, the refitted costs, what it measured), or why it failed."""
    with _probe_dir("pd-pipeline-probe-") as tmp:
        proc = _train(cfg, tmp, overrides, costed, hooks)
        refused = _check_run(proc, "pipeline")
        if refused is not None:
            return refused
        calibrated, measured = calibrate_from_run(tmp / PIPELINE_RUN, costed, runtime)
    steady_ms = measured.get("steady_time_per_minibatch_ms")
    return (float(steady_ms) if steady_ms is not None else float("inf")), calibrated, measured


def _noted(runtime: RuntimeCosts, how: str) -> RuntimeCosts:
    return dataclasses.replace(runtime, sources={**runtime.sources, "pipeline_probe": how})
