"""`pd train`'s library call: launch the workers on a compiled run, return what they measured."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pdcli.config.schema import Config
from pdcli.data.registry import resolve_steps
from pdcli.errors import UserError
from pdcli.rundir import RunDir, read_json
from pdcli.runtime import checkpoint
from pdcli.runtime.evaluation import EVAL_KEYS, eval_metrics_text, plan_evaluation
from pdcli.runtime.events import EVENTS_FILE
from pdcli.runtime.launcher import Hosts, TrainingFailed, TrainingInterrupted, check_devices, job_endpoint, launch_workers
from pdcli.runtime.metrics import read_metrics
from pdcli.runtime.placement import Placement
from pdcli.runtime.rendezvous import JOIN_TIMEOUT_S, job_prefix, open_job_store, rendezvous_id
from pdcli.runtime.restarts import keep_metrics_through, reset_attempt
from pdcli.runtime.results import ResultsNotReceived, publish_results, receive_results
from pdcli.runtime.signed import Forged, SignedStore
from pdcli.schedule import ScheduleSpec, build_for, eval_points
from pdcli.runtime.metrics import METRICS_FILE, SUMMARY_FILE, TRACE_FILE
from pdcli.runtime.session import run_spec
from pdcli.runtime.sockets import transport_from_env
from pdcli.runtime.stageio import StageIO
from pdcli.runtime.tied import check_schedule
from pdcli.runtime.launch import write_launch
from pdcli.runtime.link import LINK_FILE

__all__ = ["Job", "ResultsNotReceived", "TrainResult", "TrainingFailed", "TrainingInterrupted", "format_summary", "join_job", "run_training"]

PROGRESS_POLL_S = 0.5
SCHEDULE_CHECK_MINIBATCHES = 8
ARRIVED_KEY = "nodes/arrived/"
"""+ node rank: that node took node 0's plan and is about to start its workers (`Job.wait_for_nodes`)."""
FAILED_KEY = "nodes/failed/"
"""+ node rank: why that node stopped before its workers started (`Job.fail`)."""
NODES_POLL_S = 0.1


@dataclass(frozen=True)
class TrainResult:
    """What a finished run measured (from `train/summary.json`)."""

    final_loss: float
    final_accuracy: float | None
    samples_per_s: float
    steps: int
    stages: list[dict[str, Any]]
    """Per stage: stage_id, replicas, compute_ms, comm_ms, idle_ms, wall_ms, weight_versions_max."""
    minibatch_losses: list[float]
    eval_metrics: dict[str, float]
    """The evaluation at the end on the held-out split (`pdcli.runtime.evaluation.EVAL_KEYS`); empty: none."""
    checkpoint_dir: Path
    metrics_path: Path
    trace_path: Path

    @staticmethod
    def from_train_dir(train_dir: Path) -> "TrainResult":
        s = read_json(train_dir / SUMMARY_FILE, "training summary")
        return TrainResult(
            final_loss=float(s["final_loss"]), final_accuracy=s.get("final_accuracy"),
            samples_per_s=float(s["samples_per_s"]), steps=int(s["steps"]), stages=list(s["stages"]),
            minibatch_losses=[float(x) for x in s["minibatch_losses"]],
            eval_metrics={k: float(s[k]) for k in EVAL_KEYS if s.get(k) is not None}, checkpoint_dir=Path(s["checkpoint"]),
            metrics_path=train_dir / METRICS_FILE, trace_path=train_dir / TRACE_FILE,
        )


PREVIOUS_CHECKPOINTS = "checkpoints.previous"


def _clean_previous(cfg: Config, train_dir: Path, resume_step: int | None) -> None:
    """Stale status/error files would blame the wrong rank; old metrics and events would
    mislead. A fresh run moves old checkpoints to `checkpoints.previous/` (one generation) so
    that a later --resume never picks a checkpoint of an earlier run; a resumed run keeps the
    metrics lines up to its checkpoint and the events, and appends from there."""
    reset_attempt(train_dir)
    (train_dir / LINK_FILE).unlink(missing_ok=True)  # each launch measures its own
    shutil.rmtree(train_dir / "elastic", ignore_errors=True)  # worker stdout/stderr of the last launch
    keep_metrics_through(train_dir, resume_step, cfg.train.tensorboard)
    if resume_step is None:
        (train_dir / EVENTS_FILE).unlink(missing_ok=True)
        if (train_dir / "checkpoints").exists():
            shutil.rmtree(train_dir / PREVIOUS_CHECKPOINTS, ignore_errors=True)
            (train_dir / "checkpoints").rename(train_dir / PREVIOUS_CHECKPOINTS)


def resume_point(cfg: Config, run: RunDir, manifest: dict[str, Any], placement: Placement, hosts: Hosts = Hosts()) -> int:
    """The step of the latest complete checkpoint, after checking it fits this run (the
    stages this host saves)."""
    train_dir = run / "train"
    step = checkpoint.latest_step(train_dir)
    if step is None:
        raise UserError(
            f"--resume: no complete checkpoint in {train_dir / 'checkpoints'}",
            hint="train without --resume first (train.checkpoint_every sets how often checkpoints are taken)",
        )
    info = checkpoint.read_info(train_dir, step)
    where = checkpoint.checkpoint_dir(train_dir, step)
    if step >= cfg.train.steps:
        raise UserError(f"--resume: the latest checkpoint {where} is at step {step}, train.steps is {cfg.train.steps}: nothing left to train",
                        hint="raise train.steps to train further")
    for key, want in (("num_stages", int(manifest["num_stages"])), ("schedule", cfg.schedule.name),
                      ("num_microbatches", cfg.schedule.num_microbatches), ("optimizer", cfg.optim.name),
                      ("replicas", list(placement.replicas))):
        if key in info and info[key] != want:
            raise UserError(f"--resume: checkpoint {where} has {key}={info[key]!r}, this run {want!r}", hint=checkpoint.RESUME_HINT)
    for k in placement.stages_saved_on(hosts.node_rank, hosts.nnodes):
        payload = checkpoint.load_stage_file(train_dir, step, k)
        expected = _stage_weights(run, manifest, k)
        checkpoint.check_weights(payload["model"], expected, f"checkpoint {checkpoint.stage_file(train_dir, step, k)}", checkpoint.RESUME_HINT)
    return step


def _stage_weights(run: RunDir, manifest: dict[str, Any], stage_id: int) -> dict[str, Any]:
    import torch

    entry = manifest["stages"][stage_id]
    return dict(torch.load(run / "stages" / entry["weights"], map_location="cpu", weights_only=True))


def check_init_from(cfg: Config, run: RunDir, manifest: dict[str, Any]) -> None:
    """`train.init_from` is an exported state dict holding every weight of every stage."""
    import torch

    path = Path(cfg.train.init_from or "")
    hint = "pass a file written by `pd export RUN` for this model (train.init_from=<file>)"
    if not path.is_file():
        raise UserError(f"train.init_from: {path} does not exist", hint=hint)
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on garbage
        raise UserError(f"train.init_from: {path} is not a readable state dict ({type(e).__name__})", hint=hint) from None
    if not isinstance(weights, dict):
        raise UserError(f"train.init_from: {path} holds a {type(weights).__name__}, not a state dict", hint=hint)
    for k in range(int(manifest["num_stages"])):
        checkpoint.check_weights(weights, _stage_weights(run, manifest, k), f"train.init_from {path}", hint)


def check_inputs(cfg: Config, plan_json: dict[str, Any], manifest: dict[str, Any]) -> Placement:
    placement = Placement.from_plan(plan_json)
    if int(manifest["num_stages"]) != placement.num_stages:
        raise UserError(
            f"stages/manifest.json has {manifest['num_stages']} stages, plan.json {placement.num_stages}",
            hint="the stages are stale: re-run `pd compile`",
        )
    mb = int(manifest["microbatch_size"])
    if mb * cfg.schedule.num_microbatches != cfg.data.batch_size:
        raise UserError(
            f"stages were compiled for microbatches of {mb} samples, but data.batch_size "
            f"{cfg.data.batch_size} / schedule.num_microbatches {cfg.schedule.num_microbatches} "
            f"= {cfg.data.batch_size / cfg.schedule.num_microbatches:g}",
            hint="the stages are stale: re-run `pd compile`",
        )
    check_edges(manifest)
    check_schedule(manifest, cfg.schedule.name)
    # Pure: a bad schedule fails here, not in 4 workers; a few minibatches with the run's drain
    # pattern show the same errors as the whole run.
    evaluation = plan_evaluation(cfg)
    check_chunks(run_spec(cfg, placement, evaluation), placement, cfg.schedule.virtual_stages)
    steps = min(cfg.train.steps, 2 * max(cfg.train.checkpoint_every, cfg.train.eval_every, 1) + SCHEDULE_CHECK_MINIBATCHES)
    short = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    spec = run_spec(short, placement, dataclasses.replace(evaluation, points=eval_points(
        steps, cfg.train.eval_every, cfg.train.eval_at_start) if evaluation.points else ()))
    for stage_id, replicas in enumerate(spec.replicas):
        build_for(spec, stage_id, replicas - 1)
    return placement


def check_chunks(spec: ScheduleSpec, placement: Placement, virtual_stages: int) -> None:
    """The plan's stages are the schedule's chunks, each on the device the schedule places it on
    (virtual stages), or one stage per device (without)."""
    if not spec.chunked and not placement.virtual:
        return
    where = [placement.rank(k, 0) for k in range(placement.num_stages)]
    want = [spec.stage_of_chunk(k) for k in range(spec.num_chunks)] if spec.chunked else None
    if where != want:
        raise UserError(
            f"plan.json places its {placement.num_stages} stages on ranks {where}, but schedule.name={spec.name} with "
            f"schedule.virtual_stages={virtual_stages} runs {spec.num_chunks if spec.chunked else spec.num_stages} "
            f"chunks" + (f" on ranks {want}" if want else " one per device"),
            hint="the plan is stale: re-run `pd plan` (and `pd compile`) with this schedule")


def check_edges(manifest: dict[str, Any]) -> None:
    """Every message's layout agrees on both ends (else a receive would wait forever)."""
    ios = [StageIO.from_manifest(manifest, k) for k in range(int(manifest["num_stages"]))]
    for io in ios:
        for consumer, layout in io.acts_out.items():
            theirs = ios[consumer].acts_in.get(io.stage_id) if consumer < len(ios) else None
            if theirs != layout:
                raise UserError(
                    f"stages/manifest.json: stage {io.stage_id} sends {list(layout.names)} to stage {consumer}, "
                    f"which expects {list(theirs.names) if theirs else 'nothing'} from it (names, shapes, dtypes must match)",
                    hint="re-run `pd compile --force`",
                )
        for producer in io.acts_in:
            if io.stage_id not in ios[producer].acts_out:
                raise UserError(
                    f"stages/manifest.json: stage {io.stage_id} expects inputs from stage {producer}, which sends it nothing",
                    hint="re-run `pd compile --force`",
                )


def run_training(
    cfg: Config,
    run: RunDir,
    plan_json: dict[str, Any],
    manifest: dict[str, Any],
    hosts: Hosts = Hosts(),
    progress: bool = False,
    resume: bool = False,
    run_id: str | None = None,
    ready: Callable[[], None] | None = None,
) -> TrainResult | None:
    """Train on `run` (config.yaml and stages/ in place); `resume`: continue from the latest
    complete checkpoint; several `hosts`: this node's ranks of the job `run_id` (`join_job`),
    `ready` called once the inputs are checked, before the workers start (`Job.wait_for_nodes`).
    Returns what the run measured, or None on a node that does not run the last stage (its
    summary is on that node). Raises TrainingFailed if a worker fails (TrainingInterrupted
    on a signal), UserError on inputs that cannot run."""
    if not (run / "config.yaml").exists():
        raise FileNotFoundError(f"{run / 'config.yaml'} missing: the resolved config must be written first")
    resolve_steps(cfg)  # train.epochs -> train.steps
    placement = check_inputs(cfg, plan_json, manifest)
    check_devices(placement.world_size, hosts, cfg.cluster.device)
    transport_from_env(os.environ)  # a bad PD_TRANSPORT fails here, not in every worker
    train_dir = run / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    resume_step = resume_point(cfg, run, manifest, placement, hosts) if resume else None
    if resume_step is None and cfg.train.init_from:
        check_init_from(cfg, run, manifest)
    _clean_previous(cfg, train_dir, resume_step)
    write_launch(train_dir, plan_json, resume_step)
    if ready is not None:
        ready()
    bar = ProgressBar(train_dir / METRICS_FILE, cfg.train.steps) if progress else None
    try:
        launch_workers(run.path, placement, hosts, cfg.train.timeout_s, cfg.train.max_restarts, cfg.train.steps, run_id)
    finally:
        if bar is not None:
            bar.close()
    if summary_node(placement, hosts) != hosts.node_rank:
        return None
    return TrainResult.from_train_dir(train_dir)


def summary_node(placement: Placement, hosts: Hosts) -> int:
    """The node whose run directory gets the summary and metrics: the last stage's first
    replica's."""
    return placement.node_of(placement.rank(placement.num_stages - 1, 0), hosts.nnodes)


@dataclass(frozen=True)
class Job:
    """This node's view of a job on several hosts: its rendezvous id and node 0's store."""

    hosts: Hosts
    run_id: str
    store: Any
    """torch.distributed Store: node 0's, served by this process on node 0."""

    @property
    def node0(self) -> str:
        return f"{self.hosts.master_addr}:{self.hosts.master_port}"

    def signed_store(self) -> SignedStore:
        """pd's keys of this job in node 0's store, every value signed with the job's secret
        (`pdcli.runtime.signed`; the secret from `handshake.job_secret`: the one given out of
        band, or under --insecure-network the one the store shares)."""
        from pdcli.runtime.handshake import job_secret

        store = job_prefix(self.store, self.run_id)
        return SignedStore(store, job_secret(store), self.run_id)

    def share(self, run: RunDir, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        """Node 0: publish its artifacts (made already). Other nodes: make theirs node 0's,
        refusing any value node 0 did not sign. Returns the job's (plan, stages manifest)."""
        from pdcli import share
        from pdcli.compiler import read_manifest

        store = self.signed_store()
        if self.hosts.node_rank == 0:
            share.publish(store, run, cfg)
        else:
            try:
                share.receive(store, run, cfg, self.node0, JOIN_TIMEOUT_S)
            except Forged as e:
                raise UserError(f"node 0's ({self.node0}) plan and stages: {e}; nothing it did not sign was written",
                                hint="give every node the same secret (--secret-file or $PD_JOB_SECRET); if they hold "
                                     "the same, another process on the network wrote into the job's store") from None
        return run.read_json("plan.json"), read_manifest(run / "stages")

    def send_results(self, run: RunDir) -> list[str]:
        """The node whose last stage wrote the summary (not node 0): its summary, metrics and
        trace for node 0 (`pdcli.runtime.results`). Returns the files left out (too large).
        Raises ResultsNotReceived when node 0's store went away."""
        try:
            return publish_results(self.signed_store(), run / "train", self.hosts.node_rank)
        except RuntimeError as e:  # DistNetworkError: node 0 stopped waiting
            raise ResultsNotReceived(f"node 0 ({self.node0}) went away before it got the summary and metrics "
                                     f"({type(e).__name__}); this run directory holds them") from None

    def receive_results(self, run: RunDir, plan_json: dict[str, Any], timeout_s: float) -> tuple[TrainResult, list[str]]:
        """Node 0, where another node ran the last stage: that node's summary, metrics and trace
        into this run directory, waiting up to `timeout_s`. Returns what it measured and the files
        that node left out. Raises ResultsNotReceived."""
        node = summary_node(Placement.from_plan(plan_json), self.hosts)
        left_out = receive_results(self.signed_store(), run / "train", node, timeout_s)
        return TrainResult.from_train_dir(run / "train"), left_out

    def fail(self, error: BaseException) -> None:
        """This node stops before its workers start: the other nodes stop too, with its message
        (node 0: in place of its listing, for a node that has not read it yet; every node: under
        FAILED_KEY, which `wait_for_nodes` watches). Best effort: a store gone already is left alone."""
        from pdcli import share

        message = str(error) or type(error).__name__
        try:
            store = self.signed_store()
            if self.hosts.node_rank == 0:
                share.publish_failure(store, message)
            store.set(f"{FAILED_KEY}{self.hosts.node_rank}", message)
        except (RuntimeError, OSError):  # DistNetworkError and the like: node 0 went away
            pass

    def wait_for_nodes(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Say this node is ready to start its workers, and wait until every node is: a node that
        stopped first (`fail`) stops this one with its message, instead of this node's workers
        waiting for it until torch's rendezvous gives up. A failure message the job's secret did
        not sign is not believed (a stranger's): waiting goes on. UserError after `timeout_s`."""
        store = self.signed_store()
        me, nnodes = self.hosts.node_rank, self.hosts.nnodes
        store.set(f"{ARRIVED_KEY}{me}", "1")
        deadline_s = time.monotonic() + timeout_s
        others = [n for n in range(nnodes) if n != me]
        while True:
            for n in others:
                if store.check([f"{FAILED_KEY}{n}"]):
                    try:
                        why = store.get(f"{FAILED_KEY}{n}").decode(errors="replace")
                    except Forged:
                        continue
                    raise UserError(f"node {n} of the job stopped before training: {why}",
                                    hint=f"fix that on node {n} (its output says more), then start every node again")
            waiting = [n for n in others if not store.check([f"{ARRIVED_KEY}{n}"])]
            if not waiting:
                return
            if time.monotonic() > deadline_s:
                raise UserError(f"nodes {waiting} of the job did not get ready within {timeout_s:g} s",
                                hint="start `pd train` on every node with the same --nnodes, --master-addr and "
                                     "--master-port; see their output")
            time.sleep(NODES_POLL_S)


def join_job(hosts: Hosts, env: Mapping[str, str]) -> Job:
    """Several hosts: node 0 opens the job's store (before profiling: the others wait there),
    the others connect to it; every node derives the same rendezvous id."""
    addr, port = job_endpoint(hosts)
    hosts = dataclasses.replace(hosts, master_addr=addr, master_port=port)
    run_id = rendezvous_id(hosts.rdzv_id, port, env)
    return Job(hosts, run_id, open_job_store(run_id, addr, port, hosts.node_rank, hosts.nnodes))


class ProgressBar:
    """A tqdm bar on the launcher side that follows `metrics.jsonl` as the last stage writes it."""

    def __init__(self, metrics_path: Path, total_steps: int) -> None:
        from tqdm import tqdm

        self.path = metrics_path
        self.bar = tqdm(total=total_steps, unit="step", desc="train", leave=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="pd-progress", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(PROGRESS_POLL_S):
            self._update()

    def _update(self) -> None:
        lines = read_metrics(self.path)
        trained = [line for line in lines if "loss" in line]
        if not trained:
            return
        last = trained[-1]
        self.bar.n = min(int(last.get("step", 0)), self.bar.total)
        shown = {"loss": f"{last.get('loss', math.nan):.4f}"}
        evals = [line for line in lines if "eval_loss" in line]
        if evals:
            shown.update(eval_metrics_text(evals[-1]))
        self.bar.set_postfix(**shown, samples_per_s=f"{last.get('samples_per_s', 0):.0f}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._update()
        self.bar.close()


def format_summary(result: TrainResult) -> str:
    """A table per stage (compute/comm/idle ms) and the final loss and throughput."""
    rows = [
        [s["stage_id"], s["replicas"], f"{s['compute_ms']:.1f}", f"{s['comm_ms']:.1f}", f"{s['idle_ms']:.1f}",
         s["weight_versions_max"]]
        for s in result.stages
    ]
    table = tabulate(rows, headers=["stage", "replicas", "compute ms", "comm ms", "idle ms", "weight versions"])
    acc = "" if result.final_accuracy is None else f", accuracy {result.final_accuracy:.3f}"
    shown = eval_metrics_text(result.eval_metrics)
    held_out = "" if not shown else "\nheld-out eval: " + ", ".join(f"{k.removeprefix('eval_')} {v}" for k, v in shown.items())
    return (
        f"{table}\n\nfinal loss {result.final_loss:.4f}{acc} (training minibatches) after {result.steps} steps, "
        f"{result.samples_per_s:.1f} samples/s{held_out}\nmetrics: {result.metrics_path}\ntrace: {result.trace_path}\n"
        f"checkpoint: {result.checkpoint_dir}"
    )
