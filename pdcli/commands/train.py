"""`pd train`: ensure profile, plan and stages, then run the pipeline over torch.distributed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from typing_extensions import Annotated

from omegaconf import OmegaConf

from pdcli.commands.common import ForceOpt, OverridesArg, QuietOpt, RecipeArg, RunNameOpt, echo_err, is_tty, load, user_errors
from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.rundir import RunDir, atomic_write_text

if TYPE_CHECKING:
    from pdcli.runtime.job import Job, TrainResult


@user_errors
def train(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    force: ForceOpt = False,
    run_name: RunNameOpt = None,
    nnodes: Annotated[Optional[int], typer.Option(
        "--nnodes", help="Hosts taking part (default: $PET_NNODES or $SLURM_NNODES, else 1).")] = None,
    node_rank: Annotated[Optional[int], typer.Option(
        "--node-rank", help="This host's index among --nnodes (default: $PET_NODE_RANK or $SLURM_NODEID, else 0).")] = None,
    master_addr: Annotated[Optional[str], typer.Option(
        "--master-addr", help="Rendezvous host (default: $MASTER_ADDR or SLURM's first node, else this host).")] = None,
    master_port: Annotated[Optional[int], typer.Option(
        "--master-port", help="Rendezvous port (default: $MASTER_PORT, else a free one; several hosts: 29500).")] = None,
    rdzv_id: Annotated[Optional[str], typer.Option(
        "--rdzv-id", help="Job id, the same on every host (default: $PET_RDZV_ID or $SLURM_JOB_ID, else from the port).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest complete checkpoint.")] = False,
    secret_file: Annotated[Optional[Path], typer.Option(
        "--secret-file", help="Several hosts: the job's secret, the same file on every node (mode 0600; or $PD_JOB_SECRET).")] = None,
    insecure_network: Annotated[bool, typer.Option(
        "--insecure-network", help="Several hosts without a secret: share one through the rendezvous store (anyone who "
                                   "reaches the master port can read it).")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Train RECIPE: one process per device of the plan, running the schedule's action lists.

    Exit status: 0 done, 1 a worker failed, 2 a user error, 128+N stopped by signal N (130: Ctrl-C)."""
    loaded, run = load(recipe, overrides, run_name)
    from pdcli.data.registry import resolve_steps
    from pdcli.runtime.evaluation import plan_evaluation
    from pdcli.runtime.job import format_summary, join_job, run_training
    from pdcli.runtime.launcher import TrainingFailed, TrainingInterrupted, hosts_from_env
    from pdcli.progress import mode_for, reporting
    from pdcli.steps.train import ensure_all

    cfg = loaded.config
    resolve_steps(cfg)  # train.epochs -> train.steps
    plan_evaluation(cfg)  # a held-out split too small to evaluate fails here, before profiling
    hosts = hosts_from_env(nnodes, node_rank, master_addr, master_port, os.environ, rdzv_id)
    insecure = hosts.nnodes > 1 and secret_out_of_band(hosts.nnodes, secret_file, insecure_network)
    job = join_job(hosts, os.environ) if hosts.nnodes > 1 else None  # node 0 serves the store from here on
    try:
        try:
            if job is None or hosts.node_rank == 0:
                with reporting(mode_for(quiet)):
                    _, plan_json, manifest = ensure_all(cfg, run, force=force, echo=echo_err)
            if job is not None:
                echo_err(f"nodes:   node {hosts.node_rank} of {hosts.nnodes}, job {job.run_id} at {job.node0}"
                         + ("" if hosts.node_rank == 0 else ": waiting for node 0's plan"))
                plan_json, manifest = job.share(run, cfg)
                hosts = job.hosts
            cfg = resolved_by_plan(cfg, plan_json, run)
        except BaseException as e:  # before the workers started: the other nodes stop too
            if job is not None:
                job.fail(e)
            raise
    except KeyboardInterrupt:  # Ctrl-C before the workers started (profiling, planning, compiling)
        echo_err("interrupted")
        raise typer.Exit(130) from None
    echo_err(f"train:   {cfg.schedule.name}, {len(plan_json['stages'])} stages, {cfg.train.steps} steps -> {run / 'train'}"
             + (" (resuming)" if resume else ""))
    try:
        try:
            result = run_training(cfg, run, plan_json, manifest, hosts=hosts, progress=is_tty(), resume=resume,
                                  run_id=job.run_id if job else None, ready=job.wait_for_nodes if job else None)
        finally:
            if insecure:  # after the launch, which starts a fresh run's events anew
                from pdcli.runtime.events import append_event

                append_event(run / "train", {"event": "insecure_network", "node": hosts.node_rank,
                                             "detail": "the job's secret was shared through the rendezvous store"})
    except UserError as e:  # before the workers started: the other nodes stop too
        if job is not None:
            job.fail(e)
        raise
    except TrainingInterrupted as e:
        echo_err(f"interrupted: {e}; resume with `pd train {recipe} --resume` (same overrides)")
        raise typer.Exit(128 + e.signal_number) from None
    except TrainingFailed as e:
        echo_err(f"error: training failed: {e}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # before the launcher took over the signal
        echo_err("interrupted")
        raise typer.Exit(130) from None
    if job is not None:
        result = exchange_results(job, run, plan_json, result, cfg.train.timeout_s)
    link_lines(run, recipe, overrides or [])
    if result is None:
        echo_err("train:   done; the last stage ran on another node: its run directory holds summary.json and metrics.jsonl")
        return
    typer.echo(format_summary(result))


def secret_out_of_band(nnodes: int, secret_file: Path | None, insecure_network: bool) -> bool:
    """A job on several hosts: its secret from `--secret-file` (0600) or $PD_JOB_SECRET, put in
    this process's environment for its workers (`pdcli.runtime.handshake`); without one, a
    UserError (exit 2, before anything starts) unless `--insecure-network`, which warns and is
    then true (the workers share a secret through the rendezvous store)."""
    from pdcli.runtime.handshake import INSECURE_ENV, SECRET_ENV, read_secret_file, secret_given

    if secret_file is not None:
        try:
            os.environ[SECRET_ENV] = read_secret_file(secret_file)
        except ValueError as e:
            raise UserError(f"--secret-file {e}", hint="write the secret into a file only you can read "
                            "(`umask 077; head -c 32 /dev/urandom | base64 > job.secret`), the same on every node") from None
        return False
    if secret_given():
        return False
    if not insecure_network:
        raise UserError(f"--nnodes {nnodes}: the job's secret must reach every node outside the network, and none was given",
                        hint=f"give every node the same secret: --secret-file FILE (mode 0600) or ${SECRET_ENV}; or accept "
                             "one shared through the rendezvous store, readable by whoever reaches the master port: "
                             "--insecure-network")
    echo_err("warning: --insecure-network: the job's secret goes through the rendezvous store; whoever can reach "
             "the master port can read it and join the job")
    os.environ[INSECURE_ENV] = "1"
    return True


def exchange_results(job: "Job", run: RunDir, plan_json: dict[str, Any], result: "TrainResult | None",
                     timeout_s: float) -> "TrainResult | None":
    """Several hosts: the node that wrote the summary sends it with the metrics and trace to node 0,
    which waits for them up to `timeout_s` (train.timeout_s) and returns what the run measured. A
    warning, not a failure, when they do not come: the training itself succeeded."""
    from pdcli.runtime.job import ResultsNotReceived
    from pdcli.runtime.results import MAX_RESULT_BYTES

    node = job.hosts.node_rank
    try:
        if result is not None and node != 0:
            for name in job.send_results(run):
                echo_err(f"warning: {run / 'train' / name} is over the {MAX_RESULT_BYTES >> 20} MiB node 0 takes: "
                         "left here only")
        elif result is None and node == 0:
            result, left_out = job.receive_results(run, plan_json, timeout_s)
            for name in left_out:
                echo_err(f"warning: {name} was over {MAX_RESULT_BYTES >> 20} MiB: the last stage's node holds it")
    except ResultsNotReceived as e:
        echo_err(f"warning: {e}")
    return result


def link_lines(run: RunDir, recipe: Path, overrides: list[str]) -> None:
    """The link measured between hosts (`train/link.json`), one line, or the warning when it is
    more than 2x off the configured bandwidth."""
    from pdcli.report.compare import ReplanCommands
    from pdcli.runtime.link import link_text, link_warning, read_link

    link = read_link(run / "train")
    if link is not None:
        command = ReplanCommands(str(recipe), tuple(overrides)).calibrate_plan(str(run.path))
        echo_err(link_warning(link, command) or f"link:    {link_text(link)}")


def resolved_by_plan(cfg: Config, plan_json: dict[str, Any], run: RunDir) -> Config:
    """What `plan.search` left to the planner, set to the plan's choice; the run's config.yaml
    (what the workers load) rewritten when it changed anything."""
    from pdcli.steps.plan import config_of_plan

    chosen = config_of_plan(cfg, plan_json)
    if chosen != cfg:
        atomic_write_text(run / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(chosen)))
        search = plan_json.get("search") or {}
        front = search.get("front") or []
        echo_err(f"search:  chose {chosen.schedule.name}, {chosen.schedule.num_microbatches} microbatches "
                 f"({len(front)} configurations on the Pareto front, `pd plan --pareto` shows them)")
    return chosen
