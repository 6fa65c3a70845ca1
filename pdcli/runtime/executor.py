"""Interpret one process's action list (`pdcli.schedule`) with a handler table.

State per microbatch lives in dicts keyed by microbatch id and is freed by the action
that last needs it (SendActivations / Backward / SendGrads). Receives are posted
`RECV_LOOKAHEAD_ACTIONS` actions ahead so they fill in the background while this
process computes; sends are asynchronous.

Adaptations to the schedule's action set (noted for the schedules engineer):
- Send/Recv actions carry the adjacent peer replica; a tensor that skips stages
  (manifest edge 0 -> 2) is sent/received by the same action, to/from the replica
  `replica_for(mb, replicas[peer])` of every peer stage in the manifest.
- A stage that is neither first nor last but has `peer: data` inputs loads its data
  in Forward (LoadMicrobatch is only scheduled on the first and last stage).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from pdcli.models.loss import num_correct
from pdcli import schedule as S
from pdcli.runtime.comm import Mailbox, chunk_link
from pdcli.runtime.evaluation import EvalSums
from pdcli.runtime.divergence import Diverged, check_loss, scale_and_check_gradients
from pdcli.runtime.memory import MemoryTracker, tensor_bytes
from pdcli.runtime.metrics import IDLE, Timeline, action_category
from pdcli.runtime.placement import Placement
from pdcli.runtime.stageio import StageIO
from pdcli.runtime.tied import TiedCopy, sum_tied_grads
from pdcli.runtime.update import UpdateRule, set_lr
from pdcli.runtime.watchdog import FAULT_ENV, Heartbeat, inject_fault, parse_fault
from pdcli.runtime.weights import WeightVersions
from pdcli.torchutil.allocator import tune_allocator
from pdcli.torchutil.optim import optimizer_step, step_out_of_place, supports_out_of_place
from pdcli.torchutil.precision import autocast
from pdcli.torchutil.wgrad import DeferredWeightGrads

RECV_LOOKAHEAD_ACTIONS = 16
FP16_LOSS_SCALE = 1024.0  # static; an overflow stops training with a clear error


LossRecorder = Callable[[int, float, int, int], None]
"""record(microbatch_id, loss, num_correct (-1: not a classifier), num_samples)."""


class FP16OverflowError(RuntimeError):
    """Non-finite fp16 gradients (the static loss scale is too large for this model)."""


@dataclass
class StageContext:
    """Everything one process needs to run its actions."""

    rank: int
    stage_id: int
    replica_id: int
    module: nn.Module
    io: StageIO
    placement: Placement
    data: Any  # pdcli.data BatchSource
    num_microbatches: int
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None
    optimizer: torch.optim.Optimizer
    device: torch.device
    mailbox: Mailbox
    timeline: Timeline
    precision: str = "fp32"
    recompute: bool = False
    replica_group: Any = None
    heartbeat: Heartbeat | None = None
    record_loss: LossRecorder | None = None
    is_classifier: bool = False
    minibatch_cache: dict[int, list[Any]] = field(default_factory=dict)
    tied: list[TiedCopy] = field(default_factory=list)
    """This stage's copies of weights tied between stages (`pdcli.runtime.tied`)."""
    update_rule: UpdateRule | None = None
    """Learning rate per update and gradient clipping; None: the optimizer's lr, no clipping."""
    eval_data: Any = None
    """The held-out split (a BatchSource) that EvalForward reads; None when the run never evaluates."""
    record_eval: Callable[[int, dict[str, Any]], None] | None = None
    """record_eval(after_minibatches, metrics) on the last stage, at each EndEval."""
    num_chunks: int = 0
    """Virtual stages: the chunks of the model (`stage_id` is this chunk's id, the peers in `io`
    are chunks) whose messages `chunk_link` tells apart; 0 without virtual stages."""
    eval_ids_from: int | None = None
    """Message ids from this one on are held-out microbatches (`ScheduleSpec.eval_microbatch_id`:
    past every training id); None: the run never evaluates."""
    merge_weight_grads: bool = False
    """`schedule.merge_weight_grads` (resolved): a chunk's run of WeightGrads computes one matmul per Linear layer."""


RecvPlan = list[tuple[str, int, Any, int]]
"""What a receive action takes: (message kind, source rank, layout, link) per message."""


class ActionLoop:
    """One process's list, run action by action: receives posted `RECV_LOOKAHEAD_ACTIONS` ahead,
    a heartbeat per action, the trace (evaluation time kept apart), injected faults, `on_step`
    after each optimizer step. Subclasses say how an action runs and what a receive takes."""

    def __init__(self, ctx: StageContext, actions: Sequence[S.Action]) -> None:
        self.ctx = ctx
        self.actions = actions
        """A list, or a long run's `ActionList`: read in order, a few actions ahead, never scanned whole."""
        self.eval_s = 0.0
        """Seconds spent in evaluation blocks (their receives' waiting included)."""
        self._fault = parse_fault(os.environ.get(FAULT_ENV), ctx.rank)
        self.steps_done = 0

    def evaluating(self, action: S.Action) -> bool:
        """Part of an evaluation block: its forwards, its end, and the held-out microbatches' messages."""
        if isinstance(action, (S.EvalForward, S.EndEval)):
            return True
        first = self.ctx.eval_ids_from
        return first is not None and isinstance(action, (S.RecvActivations, S.SendActivations)) and \
            action.microbatch_id >= first

    def run_action(self, action: S.Action) -> None:
        raise NotImplementedError

    def recv_plan(self, action: Any) -> RecvPlan:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last action (sends drained): record what the run held."""

    def run(self, on_step: Callable[[int], None] | None = None) -> None:
        tl = self.ctx.timeline
        source = iter(self.actions)
        window: deque[S.Action] = deque()  # this action and the next ones, their receives posted
        while True:
            self._read_ahead(source, window)
            if not window:
                break
            action = window.popleft()
            text = S.action_text(action)
            if self.ctx.heartbeat is not None:
                self.ctx.heartbeat.beat(self.steps_done, text)
            if self._fault is not None and self.steps_done >= self._fault[0] and isinstance(action, (S.Forward, S.Backward)):
                mode, self._fault = self._fault[1], None  # once: a continued `stop` trains on
                inject_fault(mode)  # in compute: a hang there is the cause, not a symptom
            category = action_category(action)
            counted = category != IDLE  # compute and comm actions' CPU time is counted, not waiting
            start_s, cpu_s = tl.now(), tl.cpu_now() if counted else 0.0
            self.run_action(action)
            if self.evaluating(action):  # evaluation time stays out of the training timeline and its totals
                self.eval_s += tl.now() - start_s
            else:
                tl.add(type(action).__name__, category, start_s, tl.now(), text, tl.cpu_now() - cpu_s if counted else 0.0)
            if on_step is not None and isinstance(action, S.OptimizerStep):
                on_step(self.steps_done)
        self.ctx.mailbox.drain()
        self.finish()

    def _read_ahead(self, source: Iterator[S.Action], window: deque[S.Action]) -> None:
        """Read the list on to `RECV_LOOKAHEAD_ACTIONS` actions ahead, posting the receives read
        (they complete in the background)."""
        while len(window) < RECV_LOOKAHEAD_ACTIONS:
            action = next(source, None)
            if action is None:
                return
            window.append(action)
            if isinstance(action, (S.RecvActivations, S.RecvGrads)):
                for kind, src, layout, link in self.recv_plan(action):
                    self.ctx.mailbox.post_recv(kind, action.microbatch_id, src, layout, link)


class Executor(ActionLoop):
    """The interpreter of one stage (one chunk, with virtual stages): a handler per action type."""

    def __init__(self, ctx: StageContext, actions: Sequence[S.Action]) -> None:
        super().__init__(ctx, actions)
        if ctx.device.type == "cpu":
            tune_allocator()
        kinds = S.action_kinds(actions)
        self.weights = WeightVersions(
            ctx.module,
            stashed_mode=S.StashWeights in kinds,
            out_of_place_updates=supports_out_of_place(ctx.optimizer),
        )
        self.memory = MemoryTracker(self.weights.param_bytes)
        self.handlers: dict[type, Callable[[Any], None]] = {
            S.LoadMicrobatch: self.load_microbatch, S.RecvActivations: self.recv_activations,
            S.Forward: self.forward, S.SendActivations: self.send_activations, S.RecvGrads: self.recv_grads,
            S.Backward: self.backward, S.SendGrads: self.send_grads, S.WeightGrads: self.weight_grads,
            S.StashWeights: self.stash_weights,
            S.FreeWeights: self.free_weights, S.AllReduceGrads: self.all_reduce_grads,
            S.OptimizerStep: self.optimizer_step, S.EvalForward: self.eval_forward, S.EndEval: self.end_eval,
        }
        self.batches: dict[int, Any] = {}  # mb -> Batch (data inputs, target)
        self.eval_rows: dict[int, int] = {}  # message id -> held-out microbatch, while its EvalForward runs
        self.eval_cache: dict[int, list[Any]] = {}  # held-out minibatch -> its microbatches
        self.eval_sums = EvalSums()
        self.received: dict[int, dict[str, Tensor]] = {}
        self.saved_inputs: dict[int, dict[str, Tensor]] = {}
        self.outputs: dict[int, dict[str, Tensor]] = {}  # with autograd graph (no recompute)
        self.to_send: dict[int, dict[str, Tensor]] = {}
        self.losses: dict[int, Tensor] = {}
        self.param_leaves: dict[int, dict[str, Tensor] | None] = {}
        self.rng_states: dict[int, Tensor] = {}
        self.out_grads: dict[int, dict[str, Tensor]] = {}
        self.in_grads: dict[int, dict[str, Tensor]] = {}
        # split backward (WeightGrads in the list): Linear layers leave their weight gradients to W
        self.deferred = (DeferredWeightGrads(ctx.module, merge=ctx.merge_weight_grads).install()
                         if S.WeightGrads in kinds else None)
        self.last_lr: float | None = None
        """The learning rate of the last update."""
        self.last_grad_norm: float | None = None
        """The norm the last update was clipped by (before clipping); None without clipping."""
        self.last_backward_mb = 0  # the minibatch an optimizer step's gradients come from (for errors)
        self.loss_scale = FP16_LOSS_SCALE if ctx.precision == "fp16" else 1.0

    # ---- the loop (ActionLoop.run) ------------------------------------------------------
    def run_action(self, action: S.Action) -> None:
        S.dispatch(self.handlers, action)

    def recv_plan(self, action: Any) -> RecvPlan:
        return self._recv_plan(action)

    def finish(self) -> None:
        self.ctx.timeline.stats.memory = self.memory.report(self.ctx.optimizer, self.weights.peak_stashed_bytes,
                                                            self.ctx.device)

    def _note_memory(self) -> None:
        grads = tensor_bytes(p.grad for p in self.weights.live.values() if p.grad is not None)
        self.memory.note(grads, self.weights.stashed_bytes)

    def _peer_rank(self, stage_id: int, microbatch_id: int) -> int:
        p = self.ctx.placement
        return p.rank(stage_id, S.replica_for(microbatch_id, p.replicas[stage_id]))

    def _link(self, producer: int, consumer: int) -> int:
        return chunk_link(producer, consumer, self.ctx.num_chunks)

    def _recv_plan(self, action: Any) -> RecvPlan:
        io, mb, me = self.ctx.io, action.microbatch_id, self.ctx.stage_id
        if isinstance(action, S.RecvActivations):
            return [("activation", self._peer_rank(p, mb), lay, self._link(p, me)) for p, lay in io.acts_in.items()]
        return [("gradient", self._peer_rank(c, mb), lay, self._link(me, c)) for c, lay in io.grads_in.items()]

    # ---- data -----------------------------------------------------------------------
    def _microbatch(self, mb: int) -> Any:
        if mb in self.eval_rows:
            return self._eval_microbatch(self.eval_rows[mb])
        if mb not in self.batches:
            m = self.ctx.num_microbatches
            t = mb // m
            cache = self.ctx.minibatch_cache
            if t not in cache:
                for old in [k for k in cache if k < t - 1]:
                    del cache[old]
                # a stage without data inputs (the last) needs only the target
                cache[t] = self.ctx.data.batch(t, with_inputs=bool(self.ctx.io.data_inputs)).split(m)
            self.batches[mb] = cache[t][mb % m]
        return self.batches[mb]

    def _eval_microbatch(self, eval_microbatch: int) -> Any:
        m = self.ctx.num_microbatches
        t = eval_microbatch // m
        if t not in self.eval_cache:
            self.eval_cache.clear()  # held-out minibatches are read in order
            self.eval_cache[t] = self.ctx.eval_data.batch(t, with_inputs=bool(self.ctx.io.data_inputs)).split(m)
        return self.eval_cache[t][eval_microbatch % m]

    def load_microbatch(self, a: S.LoadMicrobatch) -> None:
        self._microbatch(a.microbatch_id)

    # ---- forward / backward ------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast(self.ctx.precision, self.ctx.device.type)

    def _inputs(self, mb: int) -> dict[str, Tensor]:
        io = self.ctx.io
        received = self.received.pop(mb, {})
        inputs: dict[str, Tensor] = {}
        for name in io.input_names:
            if name in io.data_inputs:
                inputs[name] = self._microbatch(mb).inputs[io.data_inputs[name]].to(self.ctx.device)
            else:
                t = received[name].detach()
                inputs[name] = t.requires_grad_(True) if t.is_floating_point() else t
        return inputs

    def _run_stage(self, inputs: dict[str, Tensor], leaves: dict[str, Tensor] | None) -> dict[str, Tensor]:
        args = tuple(inputs[n] for n in self.ctx.io.input_names)
        with self._autocast():
            out = self.ctx.module(*args) if leaves is None else functional_call(self.ctx.module, leaves, args)
        names = self.ctx.io.output_names
        if not isinstance(out, tuple) or len(out) != len(names):
            raise TypeError(f"stage {self.ctx.stage_id} returned {type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}, manifest lists {len(names)} outputs {names}")
        return dict(zip(names, out))

    def _loss(self, mb: int, outputs: dict[str, Tensor], record: bool) -> Tensor | None:
        name = self.ctx.io.loss_output
        if name is None or self.ctx.loss_fn is None:
            return None
        target = self._microbatch(mb).target.to(self.ctx.device)
        logits = outputs[name].float()
        loss = self.ctx.loss_fn(logits, target)
        if record:
            value = float(loss.detach())
            check_loss(value, self.ctx.stage_id, mb, self.ctx.num_microbatches)
            if self.ctx.record_loss is not None:
                correct = num_correct(logits, target) if self.ctx.is_classifier else -1
                self.ctx.record_loss(mb, value, correct, int(target.numel()))
        return loss

    def _weights_of(self, leaves: dict[str, Tensor] | None) -> list[Tensor]:
        """What the memory accounting counts as the stage's own, not a microbatch's: the
        weights a forward uses and the module's buffers (BatchNorm's running statistics)."""
        weights = list(self.weights.live.values()) if leaves is None else list(leaves.values())
        return weights + list(self.ctx.module.buffers())

    def forward(self, a: S.Forward) -> None:
        mb = a.microbatch_id
        inputs = self._inputs(mb)
        leaves = self.weights.leaves(a.weight_version)
        self.saved_inputs[mb] = inputs
        with self.memory.saving(mb, inputs.values(), self._weights_of(leaves)):
            if self.ctx.recompute:
                self.rng_states[mb] = torch.get_rng_state()
                with torch.no_grad():  # keep only the inputs; backward re-runs the forward
                    outputs = self._run_stage(inputs, leaves)
                    self._loss(mb, outputs, record=True)
            else:
                outputs = self._run_stage(inputs, leaves)
                self.outputs[mb] = outputs
                self.param_leaves[mb] = leaves
                loss = self._loss(mb, outputs, record=True)
                if loss is not None:
                    self.losses[mb] = loss
        if self.ctx.io.acts_out:
            self.to_send[mb] = outputs
        self._note_memory()

    def backward(self, a: S.Backward) -> None:
        mb = a.microbatch_id
        self.last_backward_mb = mb
        inputs = self.saved_inputs.pop(mb)
        if self.ctx.recompute:
            leaves = self.weights.leaves(a.weight_version)
            with self.memory.saving(mb, (), self._weights_of(leaves)):
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(self.rng_states.pop(mb))
                    outputs = self._run_stage(inputs, leaves)
                loss = self._loss(mb, outputs, record=False)
            self._note_memory()  # the recomputed activations, at their peak
        else:
            outputs, leaves, loss = self.outputs.pop(mb), self.param_leaves.pop(mb), self.losses.pop(mb, None)
        roots: list[Tensor] = []
        grads: list[Tensor | None] = []
        if loss is not None:
            roots.append(loss * self.loss_scale)
            grads.append(None)
        for name, g in self.out_grads.pop(mb, {}).items():
            if outputs[name].requires_grad:
                roots.append(outputs[name])
                grads.append(g.to(outputs[name].dtype))
        if roots:
            with self.deferred.collecting(mb) if self.deferred is not None else contextlib.nullcontext():
                torch.autograd.backward(roots, grads)
        if leaves is not None:
            self.weights.accumulate(leaves)
        self.in_grads[mb] = {
            n: (t.grad if t.grad is not None else torch.zeros_like(t))
            for n, t in inputs.items() if t.requires_grad
        }
        self.batches.pop(mb, None)
        self._note_memory()  # gradients allocated while this microbatch's activations were alive
        self.memory.released(mb)
        if self.deferred is not None:  # what its WeightGrads needs stays until then
            self.memory.hold(mb, self.deferred.held(mb), self._weights_of(leaves))

    def weight_grads(self, a: S.WeightGrads) -> None:
        if self.deferred is not None:
            self.deferred.apply(a.microbatch_id)
        self._note_memory()  # the weight gradients a first W allocates
        self.memory.released(a.microbatch_id)

    # ---- evaluation -----------------------------------------------------------------------
    def eval_forward(self, a: S.EvalForward) -> None:
        mb, module = a.microbatch_id, self.ctx.module
        self.eval_rows[mb] = a.eval_microbatch
        training = module.training
        module.eval()  # dropout off, batch norm on its running statistics
        try:
            with torch.no_grad():
                outputs = self._run_stage(self._inputs(mb), None)  # the live weights: nothing is in flight
                self._add_eval_loss(mb, outputs)
        finally:
            module.train(training)
            del self.eval_rows[mb]
        if self.ctx.io.acts_out:
            self.to_send[mb] = outputs

    def _add_eval_loss(self, mb: int, outputs: dict[str, Tensor]) -> None:
        name = self.ctx.io.loss_output
        if name is None or self.ctx.loss_fn is None:
            return
        target = self._microbatch(mb).target.to(self.ctx.device)
        logits = outputs[name].float()
        sums = self.eval_sums
        sums.loss_sum += float(self.ctx.loss_fn(logits, target))
        sums.num_microbatches += 1
        sums.num_targets += int(target.numel())
        sums.num_samples += int(target.size(0))
        sums.num_correct += num_correct(logits, target) if self.ctx.is_classifier else 0
        sums.tokens = self.ctx.is_classifier and target.dim() > 1

    def end_eval(self, a: S.EndEval) -> None:
        if self.ctx.io.loss_output is None or self.ctx.loss_fn is None:
            return
        sums = self.eval_sums
        if self.ctx.replica_group is not None:  # each replica of the last stage saw its share
            values = torch.tensor(sums.as_list(), dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.ctx.replica_group)
            sums = EvalSums.from_list(values.tolist(), self.ctx.is_classifier, sums.tokens)
        if not self.ctx.is_classifier:
            sums.num_correct = -1
        if self.ctx.record_eval is not None:
            self.ctx.record_eval(a.after_minibatches, sums.metrics())
        self.eval_sums = EvalSums()

    # ---- communication ------------------------------------------------------------------
    def send_activations(self, a: S.SendActivations) -> None:
        mb = a.microbatch_id
        outputs = self.to_send.pop(mb)
        for consumer, layout in self.ctx.io.acts_out.items():
            self.ctx.mailbox.send("activation", mb, self._peer_rank(consumer, mb), layout, outputs,
                                  self._link(self.ctx.stage_id, consumer))

    def recv_activations(self, a: S.RecvActivations) -> None:
        mb = a.microbatch_id
        got = self.received.setdefault(mb, {})
        for kind, src, layout, link in self._recv_plan(a):
            got.update(self.ctx.mailbox.take(kind, mb, src, layout, link))

    def recv_grads(self, a: S.RecvGrads) -> None:
        mb = a.microbatch_id
        total = self.out_grads.setdefault(mb, {})
        for kind, src, layout, link in self._recv_plan(a):
            for name, g in self.ctx.mailbox.take(kind, mb, src, layout, link).items():
                total[name] = g if name not in total else total[name] + g  # an output with 2 consumers

    def send_grads(self, a: S.SendGrads) -> None:
        mb = a.microbatch_id
        grads = self.in_grads.pop(mb)
        for producer, layout in self.ctx.io.grads_out.items():
            self.ctx.mailbox.send("gradient", mb, self._peer_rank(producer, mb), layout, grads,
                                  self._link(producer, self.ctx.stage_id))

    # ---- weights and optimizer ------------------------------------------------------------
    def stash_weights(self, a: S.StashWeights) -> None:
        self.weights.stash(a.version)

    def free_weights(self, a: S.FreeWeights) -> None:
        self.weights.free(a.version)

    def all_reduce_grads(self, a: S.AllReduceGrads) -> None:
        grads = self.weights.grads()
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective: ~1.2 ms each on gloo
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.ctx.replica_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_tied_grads(self) -> None:
        """Each copy of a weight tied between stages gets the holders' summed gradient."""
        if self.ctx.tied:
            sum_tied_grads(self.ctx.tied)

    def optimizer_step(self, a: S.OptimizerStep) -> None:
        self.mean_grads(a)
        self.apply_step(a)

    def mean_grads(self, a: S.OptimizerStep) -> None:
        """The gradients the step applies: summed over tied copies, divided by the microbatches, checked."""
        self.sum_tied_grads()  # before anything reads the gradients: the copies update as one weight
        scale = 1.0 / (a.num_microbatches * self.loss_scale)  # pipedream steps once per microbatch: mostly 1
        grads = {name: p.grad for name, p in self.weights.live.items()}
        try:  # one pass over the gradients: under fp16's static loss scale a non-finite one is an overflow
            scale_and_check_gradients(grads, scale, self.ctx.stage_id,
                                      self.last_backward_mb // self.ctx.num_microbatches)
        except Diverged:
            if self.loss_scale == 1.0:
                raise
            raise FP16OverflowError(
                f"stage {self.ctx.stage_id}: non-finite fp16 gradients at step {a.step} "
                f"(static loss scale {self.loss_scale:g}); use train.precision=bf16 or fp32"
            ) from None

    def apply_step(self, a: S.OptimizerStep, clip: bool = True) -> None:
        """The update itself (after `mean_grads`): learning rate, clipping (unless the caller
        clipped these gradients together with others: `clip=False`), the optimizer's step."""
        self._apply_update_rule(a.step, clip)
        if self.weights.must_update_out_of_place:
            step_out_of_place(self.ctx.optimizer)  # a stash holds the old storage: no copy
        else:
            optimizer_step(self.ctx.optimizer)
        self.ctx.optimizer.zero_grad(set_to_none=True)
        self.weights.stepped()
        self.steps_done += 1

    def _apply_update_rule(self, step: int, clip: bool = True) -> None:
        """The learning rate of this update and gradient clipping (`pdcli.runtime.update`)."""
        rule = self.ctx.update_rule
        if rule is None:
            return
        self.last_lr = rule.lr(step)
        set_lr(self.ctx.optimizer, self.last_lr)
        if not clip:
            return
        grads = [p.grad for p in self.weights.live.values() if p.grad is not None]
        elsewhere = {id(c.param) for c in self.ctx.tied if not c.in_norm}  # counted by the first holder
        counted = [p.grad for p in self.weights.live.values() if p.grad is not None and id(p) not in elsewhere]
        self.last_grad_norm = rule.clip(grads, counted)
