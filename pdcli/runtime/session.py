"""One worker's training session, top to bottom: process groups, stage, schedule, run, report."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from pdcli.compiler import load_stage, read_manifest
from pdcli.data import build_data
from pdcli.data.registry import resolve_steps
from pdcli.host import (HOST_SPEED_META, core_share, host_cores, host_speed_ms, interface_of, network_host_id, pin_process,
                        reach_address)
from pdcli.models import build_loss
from pdcli.rundir import atomic_write_json
from pdcli.runtime import checkpoint
from pdcli.runtime.comm import Mailbox, TorchDistTransport, Transport
from pdcli.runtime.evaluation import EVAL_KEYS, EvalPlan, plan_evaluation
from pdcli.runtime.heap import freeze_setup
from pdcli.runtime.divergence import LossGuard, remedies
from pdcli.runtime.chunks import ChunkRunner, chunk_actions
from pdcli.runtime.executor import Executor, StageContext
from pdcli.runtime.launch import read_plan, read_resume_step
from pdcli.runtime.link import LINK_FILE, link_text, measure_in_run
from pdcli.runtime.metrics import (
    METRICS_FILE, S_TO_MS, SUMMARY_FILE, TRACE_FILE, MetricsLog, RankStats, Timeline, chrome_trace, open_tensorboard, per_stage,
    read_metrics,
)
from pdcli.runtime.placement import Placement
from pdcli.runtime.progress import LossJournal, LossTracker, journal_path, minibatch_losses, summarize
from pdcli.runtime.resume import Checkpointer
from pdcli.schedule import ScheduleSpec, build_for, drain_points, replica_for
from pdcli.runtime.signed import SignedStore, worker_store
from pdcli.runtime.sockets import Place, SocketTransport, socket_transport_possible, transport_from_env
from pdcli.runtime.stageio import StageIO
from pdcli.runtime.tied import tied_copies
from pdcli.runtime.update import UpdateRule, clips_per_stage
from pdcli.runtime.watchdog import RESTART_COUNT_ENV, Heartbeat
from pdcli.torchutil.allocator import HEAP_HUGE_PAGES, heap_on_huge_pages
from pdcli.torchutil.optim import build_optimizer, optimizers_without_dynamo

if TYPE_CHECKING:
    from pdcli.config import Config
    from pdcli.runtime.launch import WorkerEnv

AUTO_SPIN_WAIT_MS = 20.0
"""`train.spin_wait_ms: null` where this host's workers have a core each (see `comm.spin_until`)."""


def spin_wait_s(cfg: "Config", device: torch.device, local_workers: int, cores: int) -> float:
    """How long a receive polls before it blocks: `train.spin_wait_ms`, or AUTO_SPIN_WAIT_MS on
    the CPU when this host's workers are no more than its `cores`, else 0."""
    if cfg.train.spin_wait_ms is not None:
        return cfg.train.spin_wait_ms / 1e3
    if device.type != "cpu":
        return 0.0
    return AUTO_SPIN_WAIT_MS / 1e3 if local_workers <= cores else 0.0


def bind_cpu_worker(cfg: "Config", local_rank: int, local_workers: int) -> list[int] | None:
    """Pin this CPU worker to its share of the host's cores (`train.bind_cores`, where the
    workers are no more than the cores). The cores it got, or None when it was not pinned."""
    if not cfg.train.bind_cores:
        return None
    share = core_share(local_rank, local_workers)
    if share is not None:
        pin_process(share)
    return share


def pick_device(cfg: "Config", local_rank: int) -> tuple[torch.device, str]:
    """(device, backend): NCCL on CUDA (one GPU per local rank), gloo on CPU."""
    want = cfg.cluster.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def loss_guard(cfg: "Config", stage_id: int) -> Callable[[int, float], None] | None:
    """The divergence guard of the last stage (`train.divergence`; null: none)."""
    if cfg.train.divergence is None:
        return None
    advice = remedies(cfg.schedule.name, cfg.schedule.vertical_sync, cfg.optim.lr)
    return LossGuard(cfg.train.divergence, stage_id, advice).update


def attempt_store(env: "WorkerEnv", timeout: timedelta) -> dist.Store | None:
    """The process group's store under torch's elastic agent: its store, with a prefix per
    attempt of the job. torch keys nothing by attempt (it expects a new store per rendezvous),
    but a static rendezvous keeps one store across restarts (`train.max_restarts`), where the
    gloo addresses of the previous attempt's processes would still be found. None (the
    `env://` defaults) outside the agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"pd/attempt_{os.environ.get(RESTART_COUNT_ENV, '0')}", store)


def collectives_on_the_peers_interface(one_host: bool) -> None:
    """gloo and NCCL listen on the interface of this host's name, which often resolves to
    loopback; a job on several hosts has them use the interface that reaches the rendezvous
    host instead (unless `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` say otherwise)."""
    if one_host:
        return  # loopback reaches every peer
    name = interface_of(reach_address(os.environ["MASTER_ADDR"]))
    if name is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, name)


def measure_link(cfg: "Config", train_dir: Path, run_dir: Path, env: "WorkerEnv", device: torch.device) -> dict[str, Any] | None:
    """On several hosts: the link between node 0 and node 1, measured by rank 0 and node 1's
    first rank (`pdcli.runtime.link`, at most about a second) and written by rank 0 to
    `train/link.json`; None on every other rank and on one host. The other ranks go on."""
    return measure_in_run(train_dir, read_plan(run_dir), env.rank, env.world_size, env.local_world_size, device,
                          cfg.cluster.levels)


def job_store() -> Any:
    """The job's rendezvous store, as the default process group holds it."""
    return dist.distributed_c10d._get_default_store()


def replica_groups(placement: Placement) -> dict[int, Any]:
    """A process group per replicated stage; every rank creates every group, in stage order."""
    return {k: dist.new_group(list(ranks)) for k, ranks in enumerate(placement.stage_ranks) if len(ranks) > 1}


def run_spec(cfg: "Config", placement: Placement, evaluation: EvalPlan, resume_step: int | None = None) -> ScheduleSpec:
    """The schedule of the run: drain points at checkpoints, at the checkpoint it resumes from
    and at evaluations (pipedream/2bw have nothing in flight there)."""
    drains = drain_points(cfg.train.steps, cfg.train.checkpoint_every, extra=[resume_step or 0, *evaluation.points])
    # virtual stages: the plan's stages are chunks, the schedule's stages the devices (one replica each)
    replicas = (1,) * placement.world_size if placement.virtual else placement.replicas
    return ScheduleSpec.from_config(cfg.schedule, replicas, cfg.train.steps, drains, evaluation.points,
                                    evaluation.num_microbatches(cfg.schedule.num_microbatches))


def global_clip_group(cfg: "Config", placement: Placement) -> Any:
    """A process group of every rank for the global gradient norm (`pdcli.runtime.update`),
    apart from the transport's; None when the run does not clip globally. Every rank decides
    the same from the config and creates it at the same point."""
    if cfg.optim.clip_grad_norm is None or clips_per_stage(cfg.schedule.name):
        return None
    return dist.new_group(list(range(placement.world_size)))


def make_transport(
    placement: Placement, io: StageIO | Sequence[StageIO], rank: int, device: torch.device, timeout_s: float,
    preference: str = "auto", log: Callable[[str], None] = lambda _: None, store: SignedStore | None = None,
) -> Transport:
    """The socket transport between CPU ranks (one message ~15 us on one host instead of gloo's
    ~1.5 ms): an abstract Unix socket to a rank of this host, TCP to a rank of another host,
    each connection proven with the job's secret; else torch.distributed (gloo / NCCL).
    `train.transport` picks one; the `PD_TRANSPORT=gloo|socket` environment variable overrides
    it; every rank makes the same choice. `log` gets every refused connection. `io`: the stage's,
    or every chunk's of this rank (virtual stages; messages between them stay in the process).
    `store`: the worker's signed job store (`Joined.store`), else built from the default group's."""
    default = "socket" if device.type == "cpu" and socket_transport_possible() else "gloo"
    choice = transport_from_env(os.environ) or (default if preference == "auto" else preference)
    if choice == "socket":
        ios = [io] if isinstance(io, StageIO) else list(io)
        peers = {r for one in ios for k in (*one.acts_in, *one.acts_out) for r in placement.stage_ranks[k]} - {rank}
        expected: dict[int, dict[str, set[int]]] = {}
        for one in ios:
            for k, sizes in one.recv_bytes().items():
                for r in set(placement.stage_ranks[k]) - {rank}:
                    for kind, n in sizes.items():
                        expected.setdefault(r, {}).setdefault(kind, set()).add(n)
        place = Place(network_host_id(), reach_address(os.environ["MASTER_ADDR"]))
        return SocketTransport.connect(rank, peers, timeout_s, expected, store or job_store(), place, log)
    return TorchDistTransport()


PLAN_KEY = "pd/job/plan"


def check_same_plan(store: Any, run_dir: Path, rank: int) -> None:
    """Every rank runs rank 0's plan and stages. `pd train --nnodes` gives the other hosts
    node 0's (`pdcli.share`); workers started by torchrun on several hosts read whatever run
    directory each host has, so they compare the plan and the stages' recorded hash here (rank 0's
    digest signed with the job's secret: `pdcli.runtime.signed`)."""
    from pdcli.rundir import RunDir, hash_obj
    from pdcli.share import copy_command

    run = RunDir(run_dir)
    record = run.record("stages")
    digest = hash_obj({"plan": read_plan(run_dir), "stages": record.sha256 if record else run.content_hash("stages")})
    if not isinstance(store, SignedStore):
        store = worker_store(store)  # rank 0's digest, no one else's
    if rank == 0:
        store.set(PLAN_KEY, digest)
    elif store.get(PLAN_KEY).decode() != digest:
        raise RuntimeError(f"{run_dir}: plan.json or stages/ differ from rank 0's; copy node 0's run directory to this host "
                           f"({copy_command(run_dir)}), or start every node with `pd train --nnodes`, which shares it")


@dataclass(frozen=True)
class Joined:
    """A worker in its job: what `join_job_group` set up before the stages load."""

    device: torch.device
    link: dict[str, Any] | None
    """The link between hosts as measured at the start (several hosts, `train.measure_link`)."""
    groups: dict[int, Any]
    """A process group per replicated stage (`replica_groups`)."""
    clip_group: Any
    """The group of the global gradient norm, or None (`global_clip_group`)."""
    cores: int
    """The host's cores (not this worker's share)."""
    store: SignedStore
    """The job's store, pd's values in it signed (`pdcli.runtime.signed.worker_store`)."""


def join_job_group(cfg: "Config", run_dir: Path, placement: Placement, env: "WorkerEnv", heartbeat: Heartbeat,
                   logger: logging.Logger) -> Joined:
    """The process group, rank 0's plan checked, the link measured, the groups every rank
    creates in the same order, this worker's threads and cores, its seed."""
    heartbeat.beat(0, "init_process_group")
    device, backend = pick_device(cfg, env.local_rank)
    timeout = timedelta(seconds=cfg.train.timeout_s)
    collectives_on_the_peers_interface(env.world_size == env.local_world_size)
    dist.init_process_group(backend, timeout=timeout, store=attempt_store(env, timeout), rank=env.rank, world_size=env.world_size)
    store = worker_store(job_store())
    check_same_plan(store, run_dir, env.rank)
    link = measure_link(cfg, run_dir / "train", run_dir, env, device) if cfg.train.measure_link else None
    if link is not None:
        logger.info("link %s", link_text(link))
    groups = replica_groups(placement)
    clip_group = global_clip_group(cfg, placement)
    cores = host_cores()  # before pinning: the host's, not this worker's share
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads_per_worker or max(1, cores // env.local_world_size))
        pinned = bind_cpu_worker(cfg, env.local_rank, env.local_world_size)
        if pinned is not None:
            logger.info("pinned to cores %s", pinned)
    torch.manual_seed(cfg.train.seed + env.rank)
    return Joined(device, link, groups, clip_group, cores, store)


def loss_tracker(cfg: "Config", placement: Placement, env: "WorkerEnv", train_dir: Path, replica_id: int,
                 resume_step: int | None) -> LossTracker:
    """The last stage's record of its losses (the metrics file on the rank that writes it)."""
    num_stages, m = placement.num_stages, cfg.schedule.num_microbatches
    r = placement.replicas[num_stages - 1]
    writer_rank = placement.rank(num_stages - 1, 0)
    return LossTracker(
        num_microbatches=m, num_minibatches=cfg.train.steps, log_every=cfg.train.log_every,
        batch_size=cfg.data.batch_size,
        own_per_minibatch=lambda t: sum(1 for mb in range(t * m, (t + 1) * m) if replica_for(mb, r) == replica_id),
        writer=MetricsLog(train_dir / METRICS_FILE, append=resume_step is not None,
                          tensorboard=open_tensorboard(train_dir, cfg.train.tensorboard)) if env.rank == writer_rank else None,
        guard=loss_guard(cfg, num_stages - 1),
        journal=LossJournal(journal_path(train_dir, replica_id), resume_step * m if resume_step else None),
    )


def run_session(
    cfg: "Config", run_dir: Path, placement: Placement, env: "WorkerEnv", heartbeat: Heartbeat, logger: logging.Logger
) -> None:
    """One worker's run: join the job's process group, load its stages, connect to its peers,
    run its action list with checkpoints, gather the reports on the writer, leave."""
    train_dir = run_dir / "train"
    stage_id, replica_id = placement.of(env.rank)
    resolve_steps(cfg)  # train.epochs -> train.steps, as the launcher did
    optimizers_without_dynamo()  # a worker compiles nothing
    joined = join_job_group(cfg, run_dir, placement, env, heartbeat, logger)
    device, groups, clip_group, cores = joined.device, joined.groups, joined.clip_group, joined.cores

    heartbeat.beat(0, "load_stage")
    manifest = read_manifest(run_dir / "stages")
    chunks = placement.chunks_of(env.rank)  # (stage_id,) without virtual stages
    loaded = load_stages(run_dir / "stages", chunks, device, logger)
    module, entry = loaded[stage_id]
    tied = tied_copies(manifest, placement, stage_id, module, entry)  # collective: every rank (none with chunks)
    ios = {k: StageIO.from_manifest(manifest, k) for k in chunks}
    num_stages, m = placement.num_stages, cfg.schedule.num_microbatches
    resume_step = read_resume_step(train_dir)  # None: a fresh run
    evaluation = plan_evaluation(cfg)
    spec = run_spec(cfg, placement, evaluation, resume_step)
    schedule_stage = spec.stage_replica_of(env.rank)[0] if spec.chunked else stage_id  # the device's place
    is_last = num_stages - 1 in chunks
    timeline = Timeline(env.rank, stage_id, replica_id, torch.get_num_threads())
    tracker = loss_tracker(cfg, placement, env, train_dir, replica_id, resume_step) if is_last else None
    heartbeat.beat(0, "connect")
    transport = make_transport(placement, list(ios.values()), env.rank, device, cfg.train.timeout_s, cfg.train.transport,
                               logger.warning, joined.store)
    logger.info("transport: %s", transport.describe() if isinstance(transport, SocketTransport) else "torch.distributed")
    # eager sends: the next stage gets its input before this one waits (see sends_first)
    actions = build_for(spec, schedule_stage, replica_id, start_minibatch=resume_step or 0,
                        eager_sends=not transport.stream_ordered)
    loss_name = manifest.get("loss", cfg.model.loss)
    mailbox = Mailbox(transport, device, spin_wait_s(cfg, device, env.local_world_size, cores), rank=env.rank)
    data = build_data(cfg.data, cfg.data.batch_size)

    def context(k: int) -> StageContext:
        last = k == num_stages - 1
        chunk_module = loaded[k][0]
        return StageContext(
            rank=env.rank, stage_id=k, replica_id=replica_id, module=chunk_module, io=ios[k], placement=placement,
            data=data, num_microbatches=m, loss_fn=build_loss(loss_name) if last else None,
            optimizer=build_optimizer(cfg.optim, chunk_module), device=device, mailbox=mailbox, timeline=timeline,
            precision=cfg.train.precision, recompute=cfg.train.recompute, replica_group=groups.get(k),
            heartbeat=heartbeat, record_loss=tracker.record if tracker and last else None,
            is_classifier=loss_name == "cross_entropy", tied=tied if k == stage_id else [],
            update_rule=UpdateRule.make(cfg.optim, spec, schedule_stage, cfg.data.batch_size, replica_id, clip_group),
            eval_data=evaluation.source, record_eval=tracker.record_eval if tracker and last else None,
            num_chunks=spec.num_chunks if spec.chunked else 0,
            eval_ids_from=spec.total_microbatches if spec.eval_after else None,
            merge_weight_grads=spec.merges_weight_grads(schedule_stage),
        )

    executors = {k: Executor(context(k), chunk_actions(actions, k) if spec.chunked else actions) for k in chunks}
    executor: Executor | ChunkRunner = ChunkRunner(executors, actions) if spec.chunked else executors[stage_id]
    ctx = executors[stage_id].ctx
    if tracker is not None:  # the rate of the update that applies the line's last minibatch
        rule = ctx.update_rule
        assert rule is not None
        tracker.extra = lambda t: {"lr": rule.lr(spec.step_of(schedule_stage, (t + 1) * m - 1))}
        tracker.excluded_s = lambda: executor.eval_s
    logger.info("stage %d replica %d: %d actions, %s, device %s%s", stage_id, replica_id, len(actions), cfg.schedule.name,
                device, f", chunks {list(chunks)}" if spec.chunked else "")

    checkpoints = Checkpointer(cfg, train_dir, spec, placement, env.rank, entry, module, ctx.optimizer, tracker, heartbeat, logger,
                               nnodes=env.world_size // env.local_world_size,
                               parts=tuple((k, loaded[k][1], loaded[k][0], executors[k].ctx.optimizer) for k in chunks))
    checkpoints.start(executor, resume_step)

    on_step = after_each_step(cfg.train.log_every, executor, timeline, checkpoints, logger)
    if tracker is not None:
        tracker.restart_clock()
    logger.info("%d objects of the setup frozen out of the garbage collector", freeze_setup())
    with naming_remote_peers(transport):  # training, checkpoints and reports: gloo's collectives among them
        start_s, start_time = time.perf_counter(), time.time()
        executor.run(on_step)
        loop_s = time.perf_counter() - start_s - executor.eval_s  # training only: samples/s and pd report's times
        logger.info("training loop done in %.3f s (%d optimizer steps), evaluations %.3f s", loop_s, executor.steps_done,
                    executor.eval_s)
        checkpoints.save(cfg.train.steps, executor)

        heartbeat.beat(executor.steps_done, "report")
        gather_reports(cfg, train_dir, placement, env.rank, executor, timeline, tracker, joined, loop_s, start_time,
                       first_step=resume_step or 0)
        dist.barrier()
    if isinstance(transport, SocketTransport):
        transport.close()
    dist.destroy_process_group()


def load_stages(stages_dir: Path, chunks: Sequence[int], device: torch.device, logger: logging.Logger) -> dict[int, Any]:
    """This rank's stages (its chunks under virtual stages): stage id -> (module on `device`,
    in training mode; its manifest entry)."""
    loaded = {k: load_stage(stages_dir, k) for k in chunks}
    for module, _ in loaded.values():
        module.to(device).train()
    if device.type == "cpu" and heap_on_huge_pages():
        logger.info("heap on transparent huge pages (%s)", HEAP_HUGE_PAGES)
    return loaded


def after_each_step(log_every: int, executor: "Executor | ChunkRunner", timeline: Timeline, checkpoints: Checkpointer,
                    logger: logging.Logger) -> Callable[[int], None]:
    """What the loop runs after each optimizer step: a log line every `log_every` steps, and
    the checkpoint of a drain point (`train.checkpoint_every`: a consistent cut)."""

    def on_step(steps_done: int) -> None:
        if steps_done % log_every == 0:
            st = timeline.stats
            logger.info(
                "optimizer step %d: compute %.1f ms, comm %.1f ms, idle %.1f ms so far, %d weight versions held, "
                "lr %.4g, gradient norm before clipping %s", steps_done, st.compute_ms, st.comm_ms, st.idle_ms,
                executor.weights.max_versions_held, executor.last_lr,
                "-" if executor.last_grad_norm is None else f"{executor.last_grad_norm:.4g}",
            )
        checkpoints.after_step(executor)

    return on_step


def gather_reports(cfg: "Config", train_dir: Path, placement: Placement, rank: int, executor: "Executor | ChunkRunner",
                   timeline: Timeline, tracker: LossTracker | None, joined: Joined, loop_s: float, start_time: float,
                   first_step: int) -> None:
    """Every rank's stats, losses and link gathered on the last stage's first replica, which
    writes the run's reports (after every rank is done training: with the host's speed as the
    profile measured it)."""
    writer_rank = placement.rank(placement.num_stages - 1, 0)
    stats = timeline.finish()
    stats.wall_ms -= executor.eval_s * S_TO_MS
    stats.num_weight_versions_max = executor.weights.max_versions_held
    report = {"stats": stats, "losses": tracker.all_records() if tracker else {}, "link": joined.link}
    if tracker is not None and tracker.journal is not None:
        tracker.journal.close()
    gathered: list[Any] | None = [None] * placement.world_size if rank == writer_rank else None
    dist.gather_object(report, gathered, dst=writer_rank)
    if gathered is not None:
        host_speed = host_speed_ms() if joined.device.type == "cpu" else None
        write_reports(train_dir, cfg, gathered, loop_s, tracker, first_step=first_step, eval_s=executor.eval_s,
                      host_speed=host_speed, start_time=start_time,
                      link=next((g["link"] for g in gathered if g.get("link") is not None), None))


@contextlib.contextmanager
def naming_remote_peers(transport: Transport) -> Iterator[None]:
    """An error raised inside that mentions the address of a peer on another host (gloo's
    errors name the far end of a collective by address only) gets a note naming that rank."""
    try:
        yield
    except Exception as e:
        named = transport.remote_peers_in(str(e)) if isinstance(transport, SocketTransport) else []
        if named:
            e.add_note(f"that address is {' or '.join(named)}")
        raise


def write_reports(
    train_dir: Path, cfg: "Config", gathered: list[dict[str, Any]], loop_s: float, tracker: LossTracker | None, first_step: int = 0,
    eval_s: float = 0.0, host_speed: float | None = None, start_time: float | None = None,
    link: dict[str, Any] | None = None,
) -> None:
    """Chrome trace, summary.json (with `host_speed`, `pdcli.host.host_speed_ms` measured after
    the run, where there is one; `start_time`, the wall time the loop started; `link`, the
    measured link between hosts, also written to this host's link.json), and the final metrics
    lines (exact over all last-stage replicas)."""
    all_stats: list[RankStats] = [g["stats"] for g in gathered]
    records: dict[int, Any] = {}
    for g in gathered:
        records.update(g["losses"])
    m = cfg.schedule.num_microbatches
    atomic_write_json(train_dir / TRACE_FILE, chrome_trace(all_stats))
    stages = per_stage(all_stats)
    losses = minibatch_losses(records, m)
    samples_per_s = cfg.data.batch_size * (cfg.train.steps - first_step) / max(loop_s, 1e-9)  # this launch's
    final = summarize(records, m, [cfg.train.steps - 1])
    evals = tracker.evals if tracker is not None else []
    end_eval = {k: v for e in evals if e["step"] == cfg.train.steps for k, v in e.items() if k in EVAL_KEYS}
    summary = {
        "final_loss": final["loss"], "final_accuracy": final.get("accuracy"), "samples_per_s": samples_per_s,
        "loop_s": loop_s, "steps": cfg.train.steps, "first_step": first_step, "schedule": cfg.schedule.name, "stages": stages,
        "minibatch_losses": losses, "microbatch_losses": {str(k): v[0] for k, v in sorted(records.items())},
        "checkpoint": str(checkpoint.checkpoint_dir(train_dir, cfg.train.steps)), **end_eval, "evals": evals,
        "eval_s": eval_s, **({HOST_SPEED_META: host_speed} if host_speed is not None else {}),
        **({"start_time": start_time} if start_time is not None else {}),
        **({"link": link} if link is not None else {}),
    }
    if link is not None:  # rank 0 wrote it on node 0; the summary's host gets its copy
        atomic_write_json(train_dir / LINK_FILE, link)
    atomic_write_json(train_dir / SUMMARY_FILE, summary)
    final_line = {**final, "step": cfg.train.steps, "final": True, "samples_per_s": samples_per_s, "stages": stages,
                  **end_eval}
    if tracker is not None and tracker.writer is not None and len(gathered) and _last_stage_replicas(all_stats) == 1:
        tracker.writer.write(final_line)  # the live lines are exact: append the final one
        tracker.writer.close()
        return
    # A replicated last stage: live lines saw replica 0's share only; rewrite their losses from all
    # records (each keeps the time it was written and the rate of its interval: replica 0's clock).
    if tracker is not None and tracker.writer is not None:
        tracker.writer.close()
    live = {line["step"]: line for line in read_metrics(train_dir / METRICS_FILE) if "loss" in line}
    log = MetricsLog(train_dir / METRICS_FILE, tensorboard=open_tensorboard(train_dir, cfg.train.tensorboard, fresh=True))
    every, steps = cfg.train.log_every, cfg.train.steps
    lines = []
    for start in range(0, steps, every):
        end = min(start + every, steps)
        clock = {k: live[end][k] for k in ("time", "samples_per_s") if k in live.get(end, {})}
        lines.append({"samples_per_s": samples_per_s, **clock, **summarize(records, m, list(range(start, end))),
                      "step": end, **(tracker.extra(end - 1) if tracker is not None else {})})
    lines += [e for e in evals if e["step"] < steps]  # each after the training line of its step, as live
    for line in sorted(lines, key=lambda line: (line["step"], "eval_loss" in line)):
        log.write(line)
    log.write(final_line)
    log.close()


def _last_stage_replicas(all_stats: list[RankStats]) -> int:
    last = max(s.stage_id for s in all_stats)
    return sum(1 for s in all_stats if s.stage_id == last)
