"""The train step's inputs: the profile, the plan and the stages, each reused while its inputs are
unchanged. Training itself is never reused: `pdcli.runtime.job` launches it on what these made."""

from __future__ import annotations

from typing import Any, Callable

from pdcli.config.schema import Config
from pdcli.planner.render import plan_notes
from pdcli.profiler.chain import PROFILE_ARTIFACT, Chain
from pdcli.rundir import RunDir
from pdcli.steps.compile import STAGES, ensure_stages
from pdcli.steps.plan import PLAN, config_of_plan, ensure_plan
from pdcli.steps.profile import ensure_profile, shape_fixed

Echo = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def ensure_all(
    cfg: Config, run: RunDir, force: bool = False, echo: Echo = _quiet
) -> tuple[Chain, dict[str, Any], dict[str, Any]]:
    """Profile, plan and compile as needed; `force` redoes all three. The profile goes without
    the pipeline probe where `profile.defer_pipeline_probe` and the recipe fixes the pipeline's
    shape (`shape_fixed`). What `plan.search` left to the planner is compiled as the plan chose
    it (`config_of_plan`)."""
    defer = cfg.profile.defer_pipeline_probe and shape_fixed(cfg)
    chain, reused = ensure_profile(cfg, run, force=force, defer_pipeline=defer)
    echo(f"profile: {'reused' if reused else 'measured'} {run / PROFILE_ARTIFACT}")
    plan, reused = ensure_plan(cfg, run, chain, force=force)
    echo(f"plan:    {'reused' if reused else 'wrote'} {run / PLAN}")
    for note in plan_notes(plan):
        echo(f"         {note}")
    cfg = config_of_plan(cfg, plan)
    manifest, reused = ensure_stages(cfg, run, plan, force=force)
    echo(f"compile: {'reused' if reused else 'wrote'} {run / STAGES}")
    return chain, plan, manifest
