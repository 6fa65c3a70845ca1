"""Measure what the runtime pays beyond the layers: real stages run by the runtime's own executor.

`pd profile` times each position alone; the runtime runs whole stages through its
interpreter. The probe compiles the model into PROBE_SHARES-sized stages (so their profiled
times differ enough to separate a per-action fixed cost from a scale), runs each stage's
real action list with `pdcli.runtime.executor.Executor` in this process for at least
`profile.probe_minibatches` minibatches and enough for `profile.probe_seconds` in the measured
half (by a pilot run of `profile.probe_minibatches`, fixed costs and all), once per weight mode (`pipedream`: forwards on
stashed versions; `1f1b` with a split backward: on the live module), with a transport that
delivers zeros at once, and fits per action `ms = scale * profiled_ms + fixed_ms`
(`pdcli.planner.runtime_costs`). The loss is timed on the model's own output, loading on
the data source, packing/unpacking on the probe's messages; the socket transport's latency
and bandwidth come from the host file (`pdcli.probe.pingpong` measures them once per host).
The whole-pipeline probes that train the schedule for real are `pdcli.probe.pipeline`.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from pdcli.compiler import load_stage, read_manifest
from pdcli.compiler.build import compile_stages
from pdcli.config.schema import Config
from pdcli.data import build_data
from pdcli.host import host_cores
from pdcli.models import build_loss
from pdcli.models.loss import logits_of
from pdcli.planner.runtime_costs import DIRECT, STASHED, Affine, ModeCosts, RuntimeCosts, fit_affine, steady_mean
from pdcli.planner.runtime_fit import StagePoints
from pdcli.planner.space import SplitSpace
from pdcli.probe.hostfile import HostFile
from pdcli.probe.pingpong import measure_socket_transport
from pdcli.profiler.chain import Chain
from pdcli.profiler.clock import Clock
from pdcli.progress import current
from pdcli.runtime.comm import Mailbox
from pdcli.runtime.executor import Executor, StageContext
from pdcli.runtime.heap import collector_paused, heap_frozen
from pdcli.runtime.metrics import Timeline
from pdcli.runtime.placement import Placement
from pdcli.runtime.sockets import GIL_SWITCH_INTERVAL_S
from pdcli.runtime.stageio import StageIO
from pdcli.runtime.watchdog import Heartbeat
from pdcli.schedule import ScheduleSpec, build_for
from pdcli.torchutil.optim import build_optimizer

PROBE_SHARES = (0.1, 0.2, 0.3, 0.4)
"""Shares of the profiled forward + backward the probe stages hold, in chain order."""
MODE_SCHEDULES = {STASHED: ("pipedream", False), DIRECT: ("1f1b", True)}
"""Weight mode -> (schedule, split backward) the probe runs."""
GAP_KEY = "(between actions)"
MINIBATCH_KEY = "(a minibatch)"
"""`run_stage_actions`: the run's wall time per minibatch over its second half (ms)."""
PROBE_MAX_MINIBATCHES = 400
"""The most minibatches `profile.probe_seconds` makes a run of the runtime probe."""


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class ZerosTransport:
    """A transport whose receives complete at once with zeros and whose sends go nowhere."""

    stream_ordered = False

    def isend(self, buf: torch.Tensor, dst_rank: int, tag: int) -> _Done:
        return _Done()

    def irecv(self, buf: torch.Tensor, src_rank: int, tag: int) -> _Done:
        buf.zero_()
        return _Done()


def probe_boundaries(chain: Chain, shares: Sequence[float] = PROBE_SHARES) -> list[tuple[int, int]]:
    """Half-open position ranges of about `shares` of the chain's forward + backward each
    (fewer when the chain has fewer positions; each range holds at least one)."""
    n = len(chain.nodes)
    k = min(len(shares), n)
    work = np.cumsum([node.fwd_ms + node.bwd_ms for node in chain.nodes])
    total = float(work[-1]) if n else 0.0
    cuts: list[int] = []
    acc = 0.0
    for share in shares[: k - 1]:
        acc += share / sum(shares[:k])
        cut = int(np.searchsorted(work, acc * total, side="left")) + 1
        low = (cuts[-1] if cuts else 0) + 1
        high = n - (k - 1 - len(cuts))
        cuts.append(min(max(cut, low), high))
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


def run_stage_actions(cfg: Config, stages_dir: Path, stage_id: int, num_stages: int, schedule: str,
                      split_backward: bool, num_minibatches: int, device: torch.device) -> dict[str, list[float]]:
    """Run stage `stage_id`'s real action list in this process; action name -> durations (ms),
    and GAP_KEY -> [the loop's time outside the actions per action]. Without recompute: the
    planner prices recompute's second forward itself (`pdcli.planner.costs.backward_work`)."""
    manifest = read_manifest(stages_dir)
    module, _ = load_stage(stages_dir, stage_id)
    module.to(device).train()
    io = StageIO.from_manifest(manifest, stage_id)
    m = cfg.schedule.num_microbatches
    spec = ScheduleSpec.make(schedule, num_stages, m, num_minibatches, split_backward=split_backward)
    is_last = stage_id == num_stages - 1
    loss_name = manifest.get("loss", cfg.model.loss)
    timeline = Timeline(stage_id, stage_id, 0)
    ctx = StageContext(
        rank=stage_id, stage_id=stage_id, replica_id=0, module=module, io=io,
        placement=Placement(tuple((k,) for k in range(num_stages))),
        data=build_data(cfg.data, cfg.data.batch_size), num_microbatches=m,
        loss_fn=build_loss(loss_name) if is_last else None, optimizer=build_optimizer(cfg.optim, module),
        device=device, mailbox=Mailbox(ZerosTransport(), device), timeline=timeline,
        precision=cfg.train.precision, recompute=False, is_classifier=loss_name == "cross_entropy",
        heartbeat=Heartbeat(stages_dir / f"probe_status_{stage_id}"),
    )
    actions = build_for(spec, stage_id, 0, eager_sends=True)
    with collector_paused():  # a worker's loop runs with its setup frozen out of the collector
        start_s = time.perf_counter()
        Executor(ctx, actions).run()
        loop_ms = (time.perf_counter() - start_s) * 1e3
    out: dict[str, list[float]] = {}
    for name, _, _, dur_us, _ in timeline.stats.events:
        out.setdefault(name, []).append(dur_us / 1e3)
    spans = timeline.stats.events
    inside_ms = sum(span[3] / 1e3 for span in spans)
    out[GAP_KEY] = [max(loop_ms - inside_ms, 0.0) / max(len(actions), 1)]
    if spans:  # from the start of the middle action to the end of the last
        middle, last = spans[len(spans) // 2], spans[-1]
        out[MINIBATCH_KEY] = [(last[2] + last[3] - middle[2]) / 1e3 / max(num_minibatches - num_minibatches // 2, 1)]
    return out


def profiled_ms(chain: Chain, start: int, end: int) -> float:
    """Profiled forward + backward of positions [start, end) for the profiled batch."""
    return float(sum(node.fwd_ms + node.bwd_ms for node in chain.nodes[start:end]))


def minibatches_for(seconds: float, minibatch_ms: float, least: int, most: int) -> int:
    """Minibatches a probe runs so that its measured (second) half lasts `seconds` at
    `minibatch_ms` each: at least `least`, at most `most`."""
    if minibatch_ms <= 0 or seconds <= 0:
        return least
    return int(min(most, max(least, math.ceil(2 * seconds * 1000.0 / minibatch_ms))))


def _per_minibatch(values: list[float], num_microbatches: int) -> float:
    """Total per minibatch over the steady half (LoadMicrobatch: one real load per minibatch)."""
    return steady_mean(values) * num_microbatches


def time_loss(model: nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], clock: Clock,
              warmup: int, repeats: int) -> tuple[float, float]:
    """(forward, backward) ms of the loss on the model's own output for one microbatch."""
    with torch.no_grad():
        logits = logits_of(model(*inputs)).float()
    samples_f: list[float] = []
    samples_b: list[float] = []
    for i in range(warmup + repeats):
        x = logits.detach().requires_grad_(True)
        clock.start()
        loss = loss_fn(x, target)
        f = clock.stop()
        clock.start()
        loss.backward()
        b = clock.stop()
        if i >= warmup:
            samples_f.append(f)
            samples_b.append(b)
    return float(statistics.median(samples_f)), float(statistics.median(samples_b))


def probe_runtime(cfg: Config, model: nn.Module, chain: Chain, inputs: Sequence[torch.Tensor],
                  target: torch.Tensor, device: torch.device, num_minibatches: int,
                  host: HostFile | None = None) -> RuntimeCosts:
    """The runtime's costs on this host for `model` (profiled as `chain` on one microbatch
    `inputs`, `target`), fitted from its probe stages; the socket transport's figures from
    `host` (the host calibration file), measured where it has none."""
    space = SplitSpace.from_chain(chain)
    profiled = chain.meta.get("batch_size") if isinstance(chain.meta, dict) else None
    per_mb = cfg.microbatch_size / float(profiled) if profiled else 1.0  # profiled batch -> one microbatch
    ranges = probe_boundaries(chain)
    k = len(ranges)
    m = cfg.schedule.num_microbatches
    clock = Clock(device)
    loss_fwd_ms, loss_bwd_ms = time_loss(model, inputs, target, build_loss(cfg.model.loss), clock,
                                         cfg.profile.warmup, max(cfg.profile.repeats, 5))
    modes: dict[str, ModeCosts] = {}
    sends: list[tuple[float, float]] = []
    recvs: list[tuple[float, float]] = []
    load_inputs = load_target = 0.0
    stages_seen: list[dict[str, Any]] = []
    gaps: list[float] = []
    switch_interval_s = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as a worker with the socket transport runs
    with tempfile.TemporaryDirectory(prefix="pd-probe-") as tmp, heap_frozen(), \
            current().phase("profile: runtime probe (stages run by the executor)", total=len(MODE_SCHEDULES) * k) as phase:
        manifest, _ = compile_stages(model, inputs, ranges, tmp, loss=cfg.model.loss, seed=cfg.train.seed)
        io_bytes = _message_bytes(manifest)
        for mode, (schedule, split) in MODE_SCHEDULES.items():
            fits = StagePoints(space, per_mb, loss_fwd_ms, loss_bwd_ms)
            for stage_id, (start, end) in enumerate(ranges):
                # sized by a pilot of `num_minibatches`: what a minibatch costs the runtime, fixed costs too
                times = run_stage_actions(cfg, Path(tmp), stage_id, k, schedule, split, num_minibatches, device)
                pilot_ms = times.pop(MINIBATCH_KEY, [0.0])[0]
                runs = minibatches_for(cfg.profile.probe_seconds, pilot_ms, num_minibatches, PROBE_MAX_MINIBATCHES)
                minibatch_ms = pilot_ms
                if runs > num_minibatches:
                    times = run_stage_actions(cfg, Path(tmp), stage_id, k, schedule, split, runs, device)
                    minibatch_ms = times.pop(MINIBATCH_KEY, [pilot_ms])[0]
                last = stage_id == k - 1
                fits.add(start, end, times, last)
                for action, nbytes in io_bytes[stage_id].items():
                    if action in times:
                        (sends if action.startswith("Send") else recvs).append((nbytes, steady_mean(times[action])))
                gaps.extend(times.pop(GAP_KEY))
                if stage_id == 0:
                    load_inputs = _per_minibatch(times.get("LoadMicrobatch", []), m)
                if last and k > 1:
                    load_target = _per_minibatch(times.get("LoadMicrobatch", []), m)
                stages_seen.append({"mode": mode, "stage": [start, end], "minibatches": runs,
                                    "minibatch_ms": round(minibatch_ms, 4),
                                    "measured_ms": {a: steady_mean(v) for a, v in sorted(times.items())}})
                phase.advance()
            p = fits.points
            modes[mode] = ModeCosts(fit_affine(*p["forward"]), fit_affine(*p["backward"]),
                                    fit_affine(*p["wgrad"]), fit_affine(*p["update"], single="fixed"))
    sys.setswitchinterval(switch_interval_s)
    transport = None
    if device.type == "cpu":
        transport = host.transport(measure_socket_transport) if host is not None else measure_socket_transport()
    send = fit_affine([b for b, _ in sends], [t for _, t in sends], single="fixed")
    if transport is not None:  # the probe's sends went nowhere: add the real transport's call
        send = Affine(send.scale + transport[2].scale, send.fixed_ms + transport[2].fixed_ms)
    cores = host_cores() if device.type == "cpu" else None
    return RuntimeCosts(
        modes=modes, loss_fwd_ms=loss_fwd_ms, loss_bwd_ms=loss_bwd_ms, load_inputs_ms=load_inputs,
        load_target_ms=load_target,
        send=send,
        recv=fit_affine([b for b, _ in recvs], [t for _, t in recvs], single="fixed"),
        latency_ms=transport[0] if transport else None, bandwidth_bytes_per_s=transport[1] if transport else None,
        transport="socket" if transport else "", cores=cores, gap_ms=float(statistics.median(gaps)) if gaps else 0.0,
        sources={"probe_stages": [list(r) for r in ranges], "minibatches": num_minibatches, "stages": stages_seen,
                 "precision": cfg.train.precision},
    )


def _message_bytes(manifest: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per probe stage, the bytes of each kind of message it sends and receives (one microbatch)."""
    out: dict[int, dict[str, float]] = {}
    for entry in manifest["stages"]:
        io = StageIO.from_manifest(manifest, int(entry["stage_id"]))
        sizes: dict[str, float] = {}
        for action, layouts in (("SendActivations", io.acts_out), ("RecvActivations", io.acts_in),
                                ("SendGrads", io.grads_out), ("RecvGrads", io.grads_in)):
            total = sum(layout.num_bytes for layout in layouts.values())
            if total:
                sizes[action] = float(total)
        out[int(entry["stage_id"])] = sizes
    return out
