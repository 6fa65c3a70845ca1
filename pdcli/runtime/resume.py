"""The worker side of checkpoints: when a rank takes them, what it contributes, and how a
stage starts again from one (`pd train --resume`) or from an exported state dict
(`train.init_from`).

Checkpoints are taken at drain points only (`ScheduleSpec.drain_after`, every
`train.checkpoint_every` minibatches, and at the end): after the optimizer step that
completes minibatch t on every stage, nothing is in flight. Every rank contributes its
RNG state (the last stage flushes its loss journal, `progress.LossJournal`, so metrics
continue exactly); each stage's first replica writes the stage file; rank 0 marks the
checkpoint complete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pdcli.runtime import checkpoint
from pdcli.runtime.chunks import ChunkRunner
from pdcli.runtime.placement import Placement
from pdcli.schedule import ScheduleSpec
from pdcli.runtime.watchdog import Heartbeat, checkpoint_fault

if TYPE_CHECKING:
    from pdcli.config import Config
    from pdcli.runtime.executor import Executor
    from pdcli.runtime.progress import LossTracker


def rng_state() -> dict[str, Any]:
    """This process's torch RNG state (CPU, and CUDA when present)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Checkpointer:
    """Checkpoints of one rank: restore at start, save at drain points."""

    cfg: "Config"
    train_dir: Path
    spec: ScheduleSpec
    placement: Placement
    rank: int
    entry: dict[str, Any]
    """The stage's manifest entry (param_names)."""
    module: nn.Module
    optimizer: torch.optim.Optimizer
    tracker: "LossTracker | None"
    heartbeat: Heartbeat
    logger: logging.Logger
    nnodes: int = 1
    """Hosts of the job: each host's first rank marks the checkpoint of its stages complete."""
    parts: tuple[tuple[int, dict[str, Any], nn.Module, torch.optim.Optimizer], ...] = ()
    """(stage, manifest entry, module, optimizer) of every stage this rank runs: several chunks
    with virtual stages, each its own stage file; empty: the one of `entry`, `module`, `optimizer`."""

    def __post_init__(self) -> None:
        self.stage_id, self.replica_id = self.placement.of(self.rank)
        if not self.parts:
            self.parts = ((self.stage_id, self.entry, self.module, self.optimizer),)
        # optimizer steps of this stage -> minibatches done, at every drain point
        self.at_steps = {self.spec.steps_through(self.stage_id, t): t for t in self.spec.drain_after}

    @property
    def param_names(self) -> dict[str, str]:
        return dict(self.entry["param_names"])

    def start(self, executor: "Executor | ChunkRunner", resume_step: int | None) -> None:
        """Load the checkpoint of `resume_step` (or `train.init_from`) into this rank's stages."""
        if resume_step is None:
            if self.cfg.train.init_from:
                path = Path(self.cfg.train.init_from)
                weights = torch.load(path, map_location="cpu", weights_only=True)
                for stage_id, entry, module, _ in self.parts:
                    checkpoint.load_weights_by_name(module, dict(entry["param_names"]), weights, f"train.init_from {path}",
                                                    "pass a file written by `pd export` for this model")
                    self.logger.info("stage %d: weights from %s", stage_id, path)
            return
        steps = self.spec.steps_through(self.stage_id, resume_step)
        for stage_id, entry, module, optimizer in self.parts:
            payload = checkpoint.load_stage_file(self.train_dir, resume_step, stage_id)
            where = str(checkpoint.stage_file(self.train_dir, resume_step, stage_id))
            checkpoint.restore_stage(payload, module, dict(entry["param_names"]), optimizer, where)
            if int(payload.get("num_optimizer_steps", steps)) != steps:
                raise RuntimeError(f"{where}: {payload.get('num_optimizer_steps')} optimizer steps, expected {steps}")
        executor.steps_done = steps
        if isinstance(executor, ChunkRunner):
            executor.set_version(steps)
        else:
            executor.weights.version = steps
        rng = payload.get("rng_states", {}).get(self.replica_id)
        if rng is not None:
            set_rng_state(rng)
        if self.tracker is not None:
            # the journal's records before the checkpoint; a checkpoint of an older pd holds them itself
            held = payload.get("loss_records", {}).get(self.replica_id)
            journal = self.tracker.journal
            if held is None:
                records = journal.kept if journal is not None else {}
            else:
                records = {int(k): tuple(v) for k, v in held.items()}
                if journal is not None:
                    journal.restart(records)
            expected = sum(self.tracker.own_per_minibatch(t) for t in range(resume_step))
            if len(records) != expected:
                self.logger.warning("resume: %d loss records before minibatch %d, expected %d: the metrics before "
                                    "the checkpoint are incomplete (training is not)", len(records), resume_step, expected)
            self.tracker.resume(records, resume_step, payload.get("evals", []))
        self.logger.info("stage %d: resumed from %s at minibatch %d (%d optimizer steps)", self.stage_id, where, resume_step, steps)

    def after_step(self, executor: "Executor") -> None:
        """Called after each optimizer step: checkpoint if it completes a drain point."""
        t = self.at_steps.get(executor.steps_done)
        if t is not None:
            self.save(t, executor)

    def save(self, step: int, executor: "Executor") -> None:
        """Collective over all ranks: every stage file, then COMPLETE (rank 0)."""
        self.heartbeat.beat(executor.steps_done, f"checkpoint(step={step})")
        if self.tracker is not None and self.tracker.journal is not None:
            self.tracker.journal.flush()  # the records before the checkpoint, for a resumed run
        mine = {"rank": self.rank, "rng": rng_state()}
        everyone: list[Any] = [None] * self.placement.world_size
        dist.all_gather_object(everyone, mine)  # small: RNG states
        if self.replica_id == 0:
            ranks = self.placement.stage_ranks[self.stage_id]
            by_replica = {i: everyone[r] for i, r in enumerate(ranks)}
            extra: dict[str, Any] = {
                "schedule": self.cfg.schedule.name, "num_optimizer_steps": executor.steps_done,
                "optimizer_name": self.cfg.optim.name,
                # the learning-rate schedule's position (a function of the step: for inspection)
                "samples_trained": step * self.cfg.data.batch_size, "lr": executor.last_lr,
                "rng_states": {i: o["rng"] for i, o in by_replica.items()},
            }
            if self.tracker is not None:
                extra["evals"] = list(self.tracker.evals)
            for stage_id, entry, module, optimizer in self.parts:
                checkpoint.save_stage(self.train_dir, step, stage_id, module, dict(entry["param_names"]),
                                      optimizer, executor.weights.version, extra)
        checkpoint_fault(self.rank, step, "written")
        dist.barrier()  # every stage file is written before the marker
        node = self.placement.node_of(self.rank, self.nnodes)
        if self.rank == min(r for r in range(self.placement.world_size) if self.placement.node_of(r, self.nnodes) == node):
            meta = {"schedule": self.cfg.schedule.name, "num_microbatches": self.cfg.schedule.num_microbatches,
                    "optimizer": self.cfg.optim.name, "replicas": list(self.placement.replicas)}
            checkpoint.mark_complete(self.train_dir, step, self.placement.num_stages, self.cfg.train.keep_checkpoints, meta,
                                     self.placement.stages_saved_on(node, self.nnodes))
        dist.barrier()  # the checkpoint is complete before any rank goes on
        checkpoint_fault(self.rank, step, "complete")
        self.logger.info("checkpoint of step %d written", step)
