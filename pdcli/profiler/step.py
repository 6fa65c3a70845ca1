"""The profile step: reuse `profile.json` when its inputs are unchanged, else measure and write it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Iterator

import torch

from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.host import host_cores
from pdcli.profiler.chain import Chain
from pdcli.rundir import RunDir, artifact_inputs_hash

PROFILE_ARTIFACT = "profile.json"
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


MEASURES = 5
"""What the profiler measures, counted up when it measures more (2: each position's
`wgrad_ms`; 3: the runtime probe; 4: each position's module name and the `pipe_split()`
markers; 5: what stages hold, `meta.held_memory`), so a run directory profiled by an older pd is measured
again, not reused."""


PIPELINE_PROBE_ENV = "PD_PIPELINE_PROBE"
"""`0` turns the pipeline probe off whatever `profile.pipeline_probe_minibatches` says (quick
test loops; the in-process probe still runs)."""


def pipeline_probe_minibatches(cfg: Config) -> int:
    """Minibatches of the pipeline probe: `profile.pipeline_probe_minibatches`, 0 when
    PD_PIPELINE_PROBE=0."""
    return 0 if os.environ.get(PIPELINE_PROBE_ENV) == "0" else cfg.profile.pipeline_probe_minibatches


TRAINING_ONLY = {"data": ("eval_path", "eval_fraction"), "optim": ("schedule", "clip_grad_norm")}
"""Config fields that change what training computes but not what the profile measures (clipping's
norm and its small all-reduce per update are not in the profile's optimizer step)."""


def profile_inputs_hash(cfg: Config, device: torch.device, num_threads: int | None) -> str:
    """Hash of everything the profile depends on: model, data, optimizer, profile settings,
    batch, device, and what the profiler measures."""
    section: dict[str, Any] = {
        "measures": MEASURES,
        "model": asdict(cfg.model),
        "data": {k: v for k, v in asdict(cfg.data).items() if k not in TRAINING_ONLY["data"]},
        "optim": {k: v for k, v in asdict(cfg.optim).items() if k not in TRAINING_ONLY["optim"]},
        "profile": asdict(cfg.profile),
        "microbatch_size": profile_batch_size(cfg),
        "device": device.type,
        "num_threads": num_threads,
    }
    if cfg.profile.runtime_probe:  # the probe runs the schedule's microbatches as training will
        section["probe"] = {"num_microbatches": cfg.schedule.num_microbatches, "precision": cfg.train.precision,
                            "recompute": cfg.train.recompute, "seed": cfg.train.seed}
        pipeline_minibatches = pipeline_probe_minibatches(cfg)
        section["probe"]["pipeline_minibatches"] = pipeline_minibatches
        if pipeline_minibatches:  # a real run of the schedule on this cluster's links
            section["probe"].update(schedule=asdict(cfg.schedule), batch_size=cfg.data.batch_size,
                                    devices=cfg.num_devices, levels=[asdict(x) for x in cfg.cluster.levels],
                                    train={k: getattr(cfg.train, k) for k in ("threads_per_worker", "spin_wait_ms", "transport")})
    return artifact_inputs_hash(section)


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with `num_threads` intra-op threads (None: leave torch's setting)."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ensure_profile(
    cfg: Config, run: RunDir, force: bool = False, progress: bool = True
) -> tuple[Chain, bool]:
    """The run's profile chain and whether it was reused (inputs unchanged, no `force`)."""
    device = profile_device(cfg)
    num_threads = cpu_threads_per_worker(cfg) if device.type == "cpu" else None
    inputs_hash = profile_inputs_hash(cfg, device, num_threads)
    if not force and run.fresh(PROFILE_ARTIFACT, inputs_hash):
        return load_profile(run), True

    # Imported here: the model zoo and data sets are only needed when measuring.
    from pdcli.data import Batch, build_data
    from pdcli.models import build_loss, build_model
    from pdcli.models.fit import check_model_fits_data, model_key
    from pdcli.profiler.measure import profile_model
    from pdcli.runtime.optim import build_optimizer

    batch_size = profile_batch_size(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    batch = build_data(cfg.data, batch_size).batch(PROFILE_BATCH_INDEX)
    if batch.num_samples > batch_size:
        batch = Batch(inputs=tuple(t[:batch_size] for t in batch.inputs), target=batch.target[:batch_size])
    check_model_fits_data(model, batch.inputs, batch.target, cfg, build_loss(cfg.model.loss))
    with torch_threads(num_threads):
        chain = profile_model(
            model,
            batch,
            build_loss(cfg.model.loss),
            device,
            warmup=cfg.profile.warmup,
            repeats=cfg.profile.repeats,
            progress=progress,
            config_hash=inputs_hash,
            model_name=model_key(cfg).partition("=")[2],
            optimizer_factory=lambda module: build_optimizer(cfg.optim, module),
            optimizer_name=cfg.optim.name,
        )
        if cfg.profile.runtime_probe:
            from pdcli.planner.runtime_costs import RUNTIME_META
            from pdcli.profiler.runtime_probe import probe_pipeline, probe_runtime

            # the probe's stages are compiled for the runtime's microbatch, whatever was profiled
            micro = build_data(cfg.data, cfg.data.batch_size).batch(PROFILE_BATCH_INDEX).split(cfg.schedule.num_microbatches)[0]
            runtime = probe_runtime(cfg, model, chain, tuple(t.to(device) for t in micro.inputs),
                                    micro.target.to(device), device, cfg.profile.probe_minibatches)
            pipeline_minibatches = pipeline_probe_minibatches(cfg)
            if pipeline_minibatches:
                runtime = probe_pipeline(cfg, chain, runtime, pipeline_minibatches)
            chain.meta[RUNTIME_META] = runtime.to_json()
    run.write_json(PROFILE_ARTIFACT, chain.to_json(), inputs_hash)
    return chain, False


def load_profile(run: RunDir) -> Chain:
    """The run's `profile.json` (checked against the manifest) as a Chain."""
    obj = run.read_json(PROFILE_ARTIFACT)
    try:
        return Chain.from_json(obj)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{run / PROFILE_ARTIFACT}: not a pd profile ({type(e).__name__}: {e})",
            hint="delete it and run `pd profile` again (or pass --force)",
        ) from None
