"""Profile the model a config names: the device, batch and threads the config resolves to,
every position measured (`pdcli.profiler`) and (`profile.runtime_probe`) the runtime probed
(`pdcli.probe.runtime`)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable

import torch

from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.host import HOST_SPEED_META, host_cores, host_speed_ms
from pdcli.profiler.chain import Chain
from pdcli.progress import current
from pdcli.torchutil.threads import torch_threads

if TYPE_CHECKING:  # the profiler's modules are imported when measuring
    from pdcli.probe.hostfile import HostFile
    from pdcli.probe.pipeline import RunHooks, StageLayout
    from pdcli.profiler.measure import BatchLike, LossFn

PROFILE_BATCH_INDEX = 0
"""The profile measures batch 0 of the configured data stream."""


def profile_device(cfg: Config) -> torch.device:
    """`profile.device` resolved: `auto` is CUDA when present, else the CPU."""
    choice = cfg.profile.device
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "profile.device: 'cuda' was asked for but torch sees no CUDA device "
            f"(torch {torch.__version__})",
            hint="set profile.device=cpu or profile.device=auto",
        )
    return torch.device(choice)


def profile_batch_size(cfg: Config) -> int:
    """Samples per profiled batch: `profile.batch_size`, else the schedule's microbatch size."""
    size = cfg.profile.batch_size or cfg.microbatch_size
    if size < 1:
        raise UserError(
            f"profile.batch_size: the microbatch size is {size} (data.batch_size="
            f"{cfg.data.batch_size} / schedule.num_microbatches={cfg.schedule.num_microbatches})",
            hint="set profile.batch_size or a data.batch_size >= schedule.num_microbatches",
        )
    return size


def cpu_threads_per_worker(cfg: Config) -> int:
    """Threads one CPU worker gets: `train.threads_per_worker`, else the cores / the devices.

    The profile is measured with the same number of threads, so its times are those of
    a worker. (On a small shared machine, two OpenMP threads per op can also stall for
    milliseconds per parallel region, which would make per-layer times meaningless.)
    """
    if cfg.train.threads_per_worker:
        return cfg.train.threads_per_worker
    cores = host_cores()
    return max(1, cores // max(cfg.num_devices, 1))


PIPELINE_PROBE_ENV = "PD_PIPELINE_PROBE"
"""`0` turns the pipeline probe off whatever `profile.pipeline_probe_minibatches` says (quick
test loops; the in-process probe still runs)."""
PROBE_SECONDS_ENV = "PD_PROBE_SECONDS"
"""`0` makes the probes run their minibatch counts only, whatever `profile.probe_seconds` and
`profile.pipeline_probe_seconds` say (quick test loops)."""


def probe_config(cfg: Config) -> Config:
    """`cfg` as the probes run it: their time floors off when PD_PROBE_SECONDS=0."""
    if os.environ.get(PROBE_SECONDS_ENV) != "0":
        return cfg
    profile = dataclasses.replace(cfg.profile, probe_seconds=0.0, pipeline_probe_seconds=0.0)
    return dataclasses.replace(cfg, profile=profile)


def pipeline_probe_minibatches(cfg: Config) -> int:
    """Minibatches of the pipeline probe: `profile.pipeline_probe_minibatches`, 0 when
    PD_PIPELINE_PROBE=0."""
    return 0 if os.environ.get(PIPELINE_PROBE_ENV) == "0" else cfg.profile.pipeline_probe_minibatches


def batch_point_rows(cfg: Config) -> list[int]:
    """Microbatch sizes measured besides the profiled one (`meta.batch_points`): those a search
    over `schedule.num_microbatches` (`plan.search`) needs to interpolate every count it tries,
    and with merged weight gradients the minibatch's (their rate): where the run merges them
    (`ScheduleConfig.merge_weight_grads_on`), or a search over `schedule.name` may pick a schedule
    that merges them by default."""
    schedule = cfg.schedule
    merging = schedule.merge_weight_grads_on or (
        schedule.merge_weight_grads is None and "schedule.name" in cfg.plan.search)
    merged = [cfg.data.batch_size] if merging and cfg.data.batch_size != profile_batch_size(cfg) else []
    if "schedule.num_microbatches" not in cfg.plan.search:
        return merged
    from pdcli.planner.pareto import auto_microbatches
    from pdcli.profiler.batch_points import point_rows

    rows = point_rows(cfg.data.batch_size, auto_microbatches(cfg.data.batch_size), profile_batch_size(cfg))
    return sorted({*rows, *merged})


def precision_time_ratios(model: torch.nn.Module, batches: dict[int, BatchLike], loss_fn: LossFn,
                          device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """The whole model's training step at each of SEARCHED_PRECISIONS (under its autocast, as the
    runtime runs it) as a factor on its fp32 time, at each microbatch size of `batches` (rows ->
    batch), the precisions taking turns (`meta.precision_time`)."""
    from functools import partial

    from pdcli.planner.pareto import SEARCHED_PRECISIONS
    from pdcli.profiler.batch_points import precision_time_json
    from pdcli.profiler.clock import Clock
    from pdcli.profiler.measure import ratios_to_first, step_samples
    from pdcli.torchutil.precision import autocast

    clock = Clock(device)
    model.to(device).train()
    variants = {precision: partial(autocast, precision, device.type) for precision in ("fp32", *SEARCHED_PRECISIONS)}
    factors = {}
    for rows, batch in sorted(batches.items()):
        inputs = tuple(t.to(device) for t in batch.inputs)
        factors[rows] = ratios_to_first(step_samples(model, inputs, batch.target.to(device), loss_fn, clock, warmup,
                                                     repeats, variants))
    return precision_time_json(factors)


def profile_config(
    cfg: Config, device: torch.device, num_threads: int | None, config_hash: str,
    layout_of: Callable[[Chain], StageLayout | None] | None = None, hooks: RunHooks | None = None,
    recalibrate: bool = False,
) -> Chain:
    """Measure the model, data and optimizer of `cfg` on `device` with `num_threads` intra-op
    threads; `config_hash` is recorded in the chain (the hash of the inputs it was made from).
    `layout_of(chain)`: the stages the recipe plans on the chain priced with the in-process
    probe's costs, which the pipeline probe then runs (`pdcli.probe.pipeline.pipeline_layout`);
    `hooks` give those runs the profile measured here and train them in this process
    (`pdcli.probe.pipeline.RunHooks`). The host's
    own figures come from its calibration file (`pdcli.probe.hostfile`), measured again with
    `recalibrate`."""
    # Imported here: the model zoo and data sets are only needed when measuring.
    from pdcli.data import Batch, build_data
    from pdcli.models import build_loss, build_model
    from pdcli.models.fit import check_model_fits_data, model_key
    from pdcli.profiler.measure import profile_model
    from pdcli.torchutil.allocator import tune_allocator
    from pdcli.torchutil.optim import build_optimizer

    if device.type == "cpu":  # measured under the allocator the workers run with
        tune_allocator()
    batch_size = profile_batch_size(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    batch = build_data(cfg.data, batch_size).batch(PROFILE_BATCH_INDEX)
    if batch.num_samples > batch_size:
        batch = Batch(inputs=tuple(t[:batch_size] for t in batch.inputs), target=batch.target[:batch_size])
    check_model_fits_data(model, batch.inputs, batch.target, cfg, build_loss(cfg.model.loss))
    with torch_threads(num_threads), current().phase(f"profile: timing each layer of {model_key(cfg).partition('=')[2]}"):
        chain = profile_model(
            model,
            batch,
            build_loss(cfg.model.loss),
            device,
            warmup=cfg.profile.warmup,
            repeats=cfg.profile.repeats,
            progress=False,  # the phase's bar or lines (`pdcli.progress`)
            config_hash=config_hash,
            model_name=model_key(cfg).partition("=")[2],
            optimizer_factory=lambda module: build_optimizer(cfg.optim, module),
            optimizer_name=cfg.optim.name,
        )
    with torch_threads(num_threads):
        rows = batch_point_rows(cfg)
        batches: dict[int, BatchLike] = {batch_size: batch}
        for size in rows:
            torch.manual_seed(cfg.train.seed)
            sized = build_data(cfg.data, size).batch(PROFILE_BATCH_INDEX)
            batches[size] = Batch(inputs=tuple(t[:size] for t in sized.inputs), target=sized.target[:size])
        if rows:
            from pdcli.profiler.batch_points import BATCH_POINTS_META, batch_points_json

            with current().phase(f"profile: timing the layers at {len(rows)} other microbatch sizes"):
                points = {size: profile_model(build_model(cfg.model), batches[size], build_loss(cfg.model.loss), device,
                                              warmup=cfg.profile.warmup, repeats=cfg.profile.repeats,
                                              progress=False)
                          for size in rows}
            chain.meta[BATCH_POINTS_META] = batch_points_json(points)
        if "train.precision" in cfg.plan.search:
            from pdcli.profiler.batch_points import PRECISION_META

            with current().phase("profile: timing the model at each precision"):
                chain.meta[PRECISION_META] = precision_time_ratios(model, batches, build_loss(cfg.model.loss), device,
                                                                   cfg.profile.warmup, cfg.profile.repeats)
        if cfg.profile.runtime_probe:
            from pdcli.planner.runtime_costs import RUNTIME_META
            from pdcli.probe.hostfile import HOST_META
            from pdcli.probe.runtime import probe_runtime

            host = host_file(cfg, device, recalibrate)
            # the probe's stages are compiled for the runtime's microbatch, whatever was profiled
            micro = build_data(cfg.data, cfg.data.batch_size).batch(PROFILE_BATCH_INDEX).split(cfg.schedule.num_microbatches)[0]
            runtime = probe_runtime(probe_config(cfg), model, chain, tuple(t.to(device) for t in micro.inputs),
                                    micro.target.to(device), device, cfg.profile.probe_minibatches, host)
            chain.meta[RUNTIME_META] = runtime.to_json()
            chain.meta[HOST_META] = host.record()
            if pipeline_probe_minibatches(cfg):
                chain = with_pipeline_probe(cfg, chain, device, layout_of, hooks, host)
            else:
                current().line(host.summary())
        if device.type == "cpu":  # the host's level as its costs were last measured (`pd report` compares a run's)
            chain.meta[HOST_SPEED_META] = host_speed_ms()
    return chain


def host_file(cfg: Config, device: torch.device, recalibrate: bool = False) -> HostFile:
    """This host's calibration file as `cfg.profile` places it (`pdcli.probe.hostfile`)."""
    from pdcli.probe.hostfile import HostFile, cache_root, host_key

    return HostFile(cache_root(cfg.profile.host_cache), host_key(device.type), cfg.profile.host_cache_max_days,
                    recalibrate)


def with_pipeline_probe(cfg: Config, chain: Chain, device: torch.device,
                        layout_of: Callable[[Chain], StageLayout | None] | None = None,
                        hooks: RunHooks | None = None, host: HostFile | None = None) -> Chain:
    """`chain`, which holds the in-process probe's costs (`meta.runtime`), with the pipeline
    probe's: the all-reduce of this host's workers where the cluster has 2 CPU devices or more
    (from `host`, the host file), then `probe_pipeline`'s refit on real runs of the schedule
    (`layout_of`, `hooks`: as `profile_config`'s). What a profile measured without it (`pd
    train` deferring the probe, `profile.defer_pipeline_probe`) is completed by it so."""
    from pdcli.planner.runtime_costs import RUNTIME_META, RuntimeCosts
    from pdcli.probe.hostfile import HOST_META
    from pdcli.probe.pipeline import probe_pipeline

    runtime = RuntimeCosts.from_meta(chain.meta)
    if runtime is None:
        raise ValueError("with_pipeline_probe needs a chain measured with the runtime probe (meta.runtime)")
    host = host if host is not None else host_file(cfg, device)
    if device.type == "cpu" and cfg.num_devices >= 2:
        from pdcli.probe.allreduce import with_allreduce

        runtime = with_allreduce(runtime, cpu_threads_per_worker(cfg), host)
    current().line(host.summary())
    runtime = probe_pipeline(probe_config(cfg), chain, runtime, pipeline_probe_minibatches(cfg), layout_of, hooks)
    record = host.record()
    before = chain.meta.get(HOST_META)
    if isinstance(before, dict) and before.get("file") == record["file"]:  # the in-process probe's figures too
        for field in ("reused", "measured"):
            record[field] = sorted({*before.get(field, []), *record[field]})
        record["why"] = record["why"] or before.get("why", "")
    return dataclasses.replace(chain, meta={**chain.meta, RUNTIME_META: runtime.to_json(), HOST_META: record})
