"""`pd plan`: split the model into stages for a cluster -> plan.json; `pd plan diff A B`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from pdcli.commands.common import ForceOpt, FormatOpt, QuietOpt, RunNameOpt, check_format, echo_err, load, user_errors
from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.profiler.chain import Chain
from pdcli.rundir import RunDir, atomic_write_json, read_json, sha256_file

ArgsArg = Annotated[
    Optional[List[str]],
    typer.Argument(
        help="RECIPE [key=value ...], or `diff A B` (plan files or run directories).", show_default=False
    ),
]


def gpus_override(cfg: Config, gpus: int) -> list[str]:
    """`--gpus N` as overrides: a flat cluster of N, or N/inner nodes of the innermost level."""
    if gpus < 1:
        raise UserError(f"--gpus: needs at least 1 device, got {gpus}")
    levels = cfg.cluster.levels
    if len(levels) == 1 or cfg.num_devices == gpus:
        if cfg.num_devices == gpus:
            return []
        bw = levels[0].bandwidth_bytes_per_s
        return [f"cluster.levels=[{{devices: {gpus}, bandwidth_bytes_per_s: {bw}}}]"]
    inner = levels[0].devices
    if gpus % inner:
        raise UserError(
            f"--gpus {gpus}: the cluster has {inner} devices per node (cluster.levels.0.devices); "
            f"pass a multiple of {inner}, or set cluster.levels yourself"
        )
    nodes = levels[1]
    return [
        f"cluster.levels=[{{devices: {inner}, bandwidth_bytes_per_s: {levels[0].bandwidth_bytes_per_s}}}, "
        f"{{devices: {gpus // inner}, bandwidth_bytes_per_s: {nodes.bandwidth_bytes_per_s}}}]"
    ]


def read_profile(path: Path, max_states: int) -> Chain:
    """A chain from our profile.json or from PipeDream's graph.txt (at most `max_states`
    antichain states, `plan.max_states`)."""
    if not path.exists():
        raise UserError(f"--profile: file not found: {path}")
    if path.suffix == ".txt":
        from pdcli.planner.options import search_memory_text
        from pdcli.profiler.antichain import TooManyStates
        from pdcli.profiler.graphtxt import graph_to_chain, load_graph

        try:
            return graph_to_chain(load_graph(path), max_states=max_states)
        except TooManyStates as e:
            raise UserError(
                f"{path}: {e.message} (plan.max_states={e.limit}); the search over them would need more "
                "memory than that limit allows",
                hint=f"raise plan.max_states (memory grows with its square: {e.limit} is about "
                     f"{search_memory_text(e.limit)}), or compress the graph's parallel branches first, "
                     "as PipeDream's preprocessing does") from None
    try:
        return Chain.from_json(read_json(path, "profile"))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a pd profile ({e})", hint="pass a profile.json from `pd profile` or a PipeDream graph.txt") from None


@user_errors
def plan(
    args: ArgsArg = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="Devices to plan for (sets cluster.levels).")] = None,
    profile_file: Annotated[Optional[Path], typer.Option("--profile", help="Plan this profile.json or PipeDream graph.txt instead of the run's profile.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the plan here instead of the run directory.")] = None,
    force: ForceOpt = False,
    fmt: FormatOpt = "text",
    run_name: RunNameOpt = None,
    fail_on_regression: Annotated[Optional[float], typer.Option("--fail-on-regression", help="diff: exit 1 only if predicted throughput drops by more than PCT percent.")] = None,
    pareto: Annotated[bool, typer.Option("--pareto", help="Search the schedule, microbatches, recompute and precision with the partition (as schedule.name=auto schedule.num_microbatches=auto train.recompute=auto train.precision=auto, except what the command line fixes) and print the Pareto front of time, memory and staleness.")] = False,
    calibrate: Annotated[Optional[Path], typer.Option("--calibrate", help="Refit the runtime's costs from this trained run directory (its trace.json), adopt the link bandwidth it measured between hosts (its link.json), keep them in the run's calibration.json, and re-plan.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Plan stages and replication: `pd plan RECIPE --gpus 8`, `pd plan --profile graph.txt --gpus 16`, `pd plan diff A B`."""
    check_format(fmt)
    args = list(args or [])
    if args[:1] == ["diff"]:
        diff(args[1:], fmt, fail_on_regression)
        return
    recipe = Path(args.pop(0)) if args and args[0].endswith((".yaml", ".yml")) else None
    if recipe is None and profile_file is None:
        raise UserError("pd plan needs a recipe (e.g. recipes/quickstart.yaml) or --profile FILE")
    extra = pareto_overrides(args) if pareto else []
    loaded, run = load(recipe, args, run_name, extra=extra)
    if gpus is not None:
        loaded, run = load(recipe, args, run_name, extra=extra + gpus_override(loaded.config, gpus))
    cfg = loaded.config

    from pdcli.planner import render_plan
    from pdcli.steps.plan import ensure_plan, make_plan

    if profile_file is not None:
        chain = read_profile(profile_file, cfg.plan.max_states)
        plan_json = make_plan(chain, cfg, sha256_file(profile_file))
        target = out or run / "plan.json"
        atomic_write_json(target, plan_json)
        echo_err(f"wrote {target}")
    else:
        from pdcli.steps.profile import ensure_profile

        from pdcli.progress import mode_for, reporting

        with reporting(mode_for(quiet)):
            chain, reused = ensure_profile(cfg, run)
        if reused:
            echo_err(f"profile: reused {run / 'profile.json'}")
        if calibrate is not None:
            write_calibration(run, chain, calibrate)
        plan_json, reused = ensure_plan(cfg, run, chain, force=force)
        echo_err(f"{'reused' if reused else 'wrote'} {run / 'plan.json'}" + (" (inputs unchanged; --force re-plans)" if reused else ""))
        if out is not None:
            atomic_write_json(out, plan_json)
    if pareto:
        from pdcli.planner.render import render_front

        typer.echo(render_front(plan_json, fmt))
        return
    typer.echo(render_plan(plan_json, chain, fmt))


def pareto_overrides(args: list[str]) -> list[str]:
    """`--pareto`: every field `plan.search` takes (the schedule's name, microbatches, recompute, precision)
    left to the planner, except those the command line sets."""
    from pdcli.config.schema import SEARCHABLE

    fixed = {a.split("=", 1)[0] for a in args if "=" in a}
    return [f"{key}=auto" for key in SEARCHABLE if key not in fixed]


def write_calibration(run: RunDir, chain: Chain, trained: Path) -> None:
    """Refit the profile's runtime costs to the trained run `trained`, with the link it measured
    between hosts (`train/link.json`) where it has one; write run/calibration.json."""
    from pdcli.planner.runtime_costs import RuntimeCosts
    from pdcli.report.calibrate import calibrate_from_run
    from pdcli.runtime.link import LINK_FILE, level_key, read_link
    from pdcli.steps.plan import CALIBRATION, profile_sha256

    if not trained.is_dir():
        raise UserError(f"--calibrate: {trained} is not a run directory", hint="pass the directory `pd train` trained in (e.g. runs/quickstart)")
    base = RuntimeCosts.from_meta(chain.meta)
    if base is None:
        raise UserError(f"{run / 'profile.json'} has no runtime costs to calibrate (profile.runtime_probe was off)",
                        hint="re-profile with profile.runtime_probe=true (`pd profile RECIPE --force`)")
    calibrated, measured = calibrate_from_run(trained, chain, base)
    link = read_link(trained / "train")
    atomic_write_json(run / CALIBRATION, {"profile_sha256": profile_sha256(run), "runtime": calibrated.to_json(),
                                          "measured": measured, **({"link": link} if link is not None else {})})
    echo_err(f"calibration: wrote {run / CALIBRATION} from {trained}")
    if link is not None:
        echo_err(f"calibration: {level_key(link)} {link['configured_bandwidth_bytes_per_s']:.3g} -> "
                 f"{link['measured_bandwidth_bytes_per_s']:.3g}, the link the run measured between node "
                 f"{link['between'][0]} and node {link['between'][1]} ({trained / 'train' / LINK_FILE})")
    shared = measured.get("shared_cores")
    if shared and shared["capped"]:
        echo_err(f"calibration: the run's compute spans took {shared['run_compute_ms']:.2f} ms per minibatch, the replay "
                 f"at the run's time computes {shared['replayed_compute_ms']:.2f}: its workers outnumber the cores and "
                 f"the kernel stretched their compute more than the replay's queue for the cores does")


def diff(paths: list[str], fmt: str, fail_on_regression: Optional[float]) -> None:
    from pdcli.planner import diff_plans, render_diff
    from pdcli.steps.plan import load_plan_file

    if len(paths) != 2:
        raise UserError(f"pd plan diff takes two plans (files or run directories), got {len(paths)}")
    a, b = (load_plan_file(Path(p)) for p in paths)
    result = diff_plans(a, b)
    typer.echo(render_diff(result, fmt))
    if fail_on_regression is not None:
        raise typer.Exit(1 if result.regressed(fail_on_regression) else 0)
    raise typer.Exit(1 if result.changed else 0)
