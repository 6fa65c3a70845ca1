"""`pd compile`: one importable module per stage, with its weights -> stages/."""

from __future__ import annotations

import typer

from typing import Any

from tabulate import tabulate

from pdcli.commands.common import ForceOpt, OverridesArg, QuietOpt, RecipeArg, RunNameOpt, echo_err, load, user_errors


@user_errors
def compile(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    force: ForceOpt = False,
    run_name: RunNameOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Split the model at the plan's boundaries into stage_<k>.py files, verified against the model."""
    loaded, run = load(recipe, overrides, run_name)
    from pdcli.steps.compile import ensure_stages
    from pdcli.steps.plan import ensure_plan
    from pdcli.steps.profile import ensure_profile

    from pdcli.progress import mode_for, reporting

    cfg = loaded.config
    with reporting(mode_for(quiet)):
        chain, _ = ensure_profile(cfg, run)
    plan_json, _ = ensure_plan(cfg, run, chain)
    manifest, reused = ensure_stages(cfg, run, plan_json, force=force)
    echo_err(
        f"{'reused' if reused else 'wrote and verified'} {run / 'stages'}"
        + (" (plan and model unchanged; --force regenerates)" if reused else "")
    )
    typer.echo(describe_manifest(manifest))


def _wires(entries: list[dict[str, Any]], key: str) -> str:
    return "\n".join(f"{e['name']} {tuple(e['shape'])} {e['dtype']} {key} {e.get('peer', e.get('peers'))}" for e in entries)


def describe_manifest(manifest: dict[str, Any]) -> str:
    """One row per stage: its file, what it receives (from whom) and sends (to whom)."""
    rows = [
        [s["stage_id"], s["module"], len(s.get("param_names", {})), _wires(s["inputs"], "from"), _wires(s["outputs"], "to")]
        for s in manifest["stages"]
    ]
    return tabulate(rows, headers=["stage", "module", "params", "receives", "sends"], tablefmt="simple")
