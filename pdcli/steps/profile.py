"""The profile step: reuse `profile.json` when its inputs are unchanged, else measure and write it."""

from __future__ import annotations

import subprocess
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from pdcli.config.schema import Config
from pdcli.config.loader import run_dir_path
from pdcli.errors import UserError
from pdcli.profiler.chain import PROFILE_ARTIFACT, Chain
from pdcli.probe.profile import (
    batch_point_rows,
    cpu_threads_per_worker,
    pipeline_probe_minibatches,
    probe_config,
    profile_batch_size,
    profile_config,
    profile_device,
    with_pipeline_probe,
)
from pdcli.probe.profile_cache import ProfileCache
from pdcli.probe.pipeline import RunHooks
from pdcli.progress import current
from pdcli.rundir import RunDir, artifact_inputs_hash, atomic_write_text
from pdcli.steps.plan import planned_layout



MEASURES = 14
"""What the profiler measures, counted up when it measures more (2: each position's
`wgrad_ms`; 3: the runtime probe; 4: each position's module name and the `pipe_split()`
markers; 5: what stages hold, `meta.held_memory`; 6: the probe's stages without recompute, which the
planner prices; 7: the pipeline probe runs the stages the recipe plans; 8: the host's speed,
`meta.host_speed_ms`; 9: the all-reduce between compute; 10: `meta.precision_time` at each
microbatch size; 11: the pipeline probe's receives priced after their message's send; 12: under the
workers' allocator, `pdcli.torchutil.allocator`; 13: the compute's CPU time on shared cores,
`RuntimeCosts.shared_cpu_scale`; 14: on the workers' huge-page heap), so a run
directory profiled by an older pd is measured again, not reused."""


UNMEASURED_SETTINGS = ("host_cache", "host_cache_max_days", "defer_pipeline_probe")
"""Profile settings that say where the host's figures are kept (a profile copies the figures it
used, `pdcli.probe.hostfile`) or when the pipeline probe runs, not what is measured."""
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
        "profile": {k: v for k, v in asdict(probe_config(cfg).profile).items() if k not in UNMEASURED_SETTINGS},
        "microbatch_size": profile_batch_size(cfg),
        "device": device.type,
        "num_threads": num_threads,
    }
    rows = batch_point_rows(cfg)
    if rows:  # `meta.batch_points`
        section["batch_points"] = rows
    if "train.precision" in cfg.plan.search:  # `meta.precision_time`
        section["precision_time"] = True
    if cfg.profile.runtime_probe:  # the probe runs the schedule's microbatches as training will
        section["probe"] = {"num_microbatches": cfg.schedule.num_microbatches, "precision": cfg.train.precision,
                            "recompute": cfg.train.recompute, "seed": cfg.train.seed}
        pipeline_minibatches = pipeline_probe_minibatches(cfg)
        section["probe"]["pipeline_minibatches"] = pipeline_minibatches
        if pipeline_minibatches:
            section["probe"]["pipeline_runs"] = cfg.profile.pipeline_probe_runs
        if pipeline_minibatches:  # a real run of the schedule on this cluster's links
            section["probe"].update(schedule=asdict(cfg.schedule), batch_size=cfg.data.batch_size,
                                    devices=cfg.num_devices, levels=[asdict(x) for x in cfg.cluster.levels],
                                    train={k: getattr(cfg.train, k)
                                           for k in ("threads_per_worker", "spin_wait_ms", "transport", "bind_cores")})
    return artifact_inputs_hash(section)


def ensure_profile(cfg: Config, run: RunDir, force: bool = False, recalibrate: bool = False,
                   defer_pipeline: bool = False) -> tuple[Chain, bool]:
    """The run's profile chain and whether it was reused (inputs unchanged, no `force`): the
    run's own, else this host's profile of the same inputs copied in (`profile_cache`);
    `recalibrate` measures the host's own figures again (and so the profile). With
    `defer_pipeline` (`pd train` where `profile.defer_pipeline_probe` and `shape_fixed`) a
    profile without the pipeline probe does: the one there, else one measured so. Without it,
    such a profile there is completed by the probe (`with_pipeline_probe`) instead of measured again."""
    device = profile_device(cfg)
    num_threads = cpu_threads_per_worker(cfg) if device.type == "cpu" else None
    inputs_hash = profile_inputs_hash(cfg, device, num_threads)
    layout_of = lambda costed: planned_layout(costed, cfg)  # noqa: E731
    hooks = RunHooks(seed_profile, train_probe)
    reuse = not (force or recalibrate)
    if reuse and run.fresh(PROFILE_ARTIFACT, inputs_hash):
        return load_profile(run), True
    cache = profile_cache(cfg, device)
    alone = without_pipeline_probe(cfg)
    alone_hash = profile_inputs_hash(alone, device, num_threads) if alone is not cfg else inputs_hash
    for cached_hash in ((inputs_hash, alone_hash) if defer_pipeline else (inputs_hash,)) if reuse else ():
        chain = copied_from_cache(cache, run, cached_hash)
        if chain is not None:
            return chain, True
    if alone is not cfg and reuse and run.fresh(PROFILE_ARTIFACT, alone_hash):
        chain = load_profile(run)
        if defer_pipeline:
            return chain, True
        chain = with_pipeline_probe(cfg, chain, device, layout_of, hooks)
        write_profile(run, cache, chain, inputs_hash)
        return chain, False
    if defer_pipeline:
        cfg, inputs_hash = alone, alone_hash
    chain = profile_config(cfg, device, num_threads, inputs_hash, layout_of=layout_of, hooks=hooks,
                           recalibrate=recalibrate)
    write_profile(run, cache, chain, inputs_hash)
    return chain, False


def profile_cache(cfg: Config, device: torch.device) -> ProfileCache:
    """This host's profiles where `cfg.profile` keeps its host file (`pdcli.probe.profile_cache`)."""
    from pdcli.probe.hostfile import cache_root, host_key

    return ProfileCache(cache_root(cfg.profile.host_cache), host_key(device.type), cfg.profile.host_cache_max_days)


def write_profile(run: RunDir, cache: ProfileCache, chain: Chain, inputs_hash: str) -> None:
    """`chain`, just measured, as the run's profile and this host's for `inputs_hash`."""
    obj = chain.to_json()
    run.write_json(PROFILE_ARTIFACT, obj, inputs_hash)
    cache.put(inputs_hash, obj)


def copied_from_cache(cache: ProfileCache, run: RunDir, inputs_hash: str) -> Chain | None:
    """This host's profile for `inputs_hash`, written as the run's (None: the cache has none)."""
    got = cache.get(inputs_hash)
    if got is None:
        return None
    obj, path, age_days = got
    try:
        chain = Chain.from_json(obj)
    except (ValueError, KeyError, TypeError):
        return None  # measured again, and the entry replaced
    run.write_json(PROFILE_ARTIFACT, obj, inputs_hash)
    current().line(f"profile: copied from {path} (this host's, the same inputs, measured "
                   f"{_days(age_days)}; --force measures again)")
    return chain


def _days(age_days: float) -> str:
    if age_days < 1 / 24:
        return f"{max(0.0, age_days * 24 * 60):.0f} min ago"
    return f"{age_days * 24:.1f} h ago" if age_days < 2 else f"{age_days:.0f} days ago"


def without_pipeline_probe(cfg: Config) -> Config:
    """`cfg` as its profile is measured without the pipeline probe (`cfg` itself where the
    probe is off already: no runtime probe, `profile.pipeline_probe_minibatches=0`)."""
    if not (cfg.profile.runtime_probe and pipeline_probe_minibatches(cfg)):
        return cfg
    return replace(cfg, profile=replace(cfg.profile, pipeline_probe_minibatches=0))


def shape_fixed(cfg: Config) -> bool:
    """The recipe fixes the pipeline's shape, so the planner only places its cuts: no
    `plan.search`, no virtual stages, the stage count given (`plan.num_stages` or
    `plan.boundaries`) and each stage's replicas (`plan.replicas`, `plan.straight`, or as many
    stages as devices). The pipeline probe would then run the layout the run trains and price
    nothing the planner chooses between (`profile.defer_pipeline_probe`)."""
    plan = cfg.plan
    if plan.search or int(cfg.schedule.virtual_stages) != 1:
        return False
    stages = plan.num_stages or (len(plan.boundaries) + 1 if plan.boundaries is not None else None)
    if not stages:
        return False
    return bool(plan.straight or plan.replicas is not None or stages >= cfg.num_devices)


def seed_profile(cfg: Config, chain: Chain) -> None:
    """Write `chain`, measured for `cfg` by another process, as the profile of `cfg`'s run
    directory under the inputs hash `cfg` gives, so that `ensure_profile` there reuses it instead
    of measuring again."""
    device = profile_device(cfg)
    num_threads = cpu_threads_per_worker(cfg) if device.type == "cpu" else None
    run = RunDir(run_dir_path(cfg)).create()
    run.write_json(PROFILE_ARTIFACT, chain.to_json(), profile_inputs_hash(cfg, device, num_threads))


def train_probe(recipe: Path, overrides: list[str]) -> subprocess.CompletedProcess[str]:
    """`pd train recipe overrides` of a probe in this process: profile (seeded), plan, compile
    and train as the command does, quietly; its exit status and message as a finished
    process's: 2 where the configuration is refused (a UserError, before any worker started),
    1 where the run failed (TrainingFailed: a worker died or hung, the job's own fault
    handling stopped it)."""
    from pdcli.config import load_config
    from pdcli.progress import reporting
    from pdcli.runtime.job import run_training
    from pdcli.runtime.launcher import TrainingFailed
    from pdcli.steps.compile import ensure_stages
    from pdcli.steps.plan import config_of_plan, ensure_plan

    args = ["pd", "train", str(recipe), *overrides]
    try:
        loaded = load_config(recipe, overrides)
        run = RunDir(run_dir_path(loaded.config)).create()
        atomic_write_text(run / "config.yaml", loaded.to_yaml())
        with reporting("off"):  # the steps of `pdcli.steps.train.ensure_all`, the profile seeded
            chain, _ = ensure_profile(loaded.config, run)
            plan_json, _ = ensure_plan(loaded.config, run, chain)
            cfg = config_of_plan(loaded.config, plan_json)
            manifest, _ = ensure_stages(cfg, run, plan_json)
        run_training(cfg, run, plan_json, manifest)
    except UserError as e:
        return subprocess.CompletedProcess(args, 2, "", f"error: {e}")
    except TrainingFailed as e:
        return subprocess.CompletedProcess(args, 1, "", f"error: training failed: {e}")
    return subprocess.CompletedProcess(args, 0, "", "")


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
