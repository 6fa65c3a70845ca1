"""Load a recipe: compose config groups, apply overrides, validate, resolve.

Precedence: schema defaults < group files (recipe `defaults:` list) < recipe body <
command-line `key=value` (and `~key` to delete, `group=name` to pick another group file).
Every problem is collected and reported together, naming the file and key that set it.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pdcli.config.schema import GROUPS, Config, check_values
from pdcli.config.validate import validate_tree
from pdcli.errors import ConfigError, UserError
from pdcli.schedule.handwritten import check_lines
from pdcli.schedule.orders import device_lines
from pdcli.schedule.spec import PIPEDREAM, SCHEDULES, rules, written_merge_problem

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMMAND_LINE = "command line"
"""The source `Loaded.sources` names for an override."""


@dataclass
class Loaded:
    """A resolved config plus where each key came from."""

    config: Config
    sources: dict[str, str] = field(default_factory=dict)
    """dotted key -> the file (or `command line`) that set it last."""
    recipe: Path | None = None
    notes: list[str] = field(default_factory=list)
    """What the loader decided for the user (printed by the commands)."""

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self.config))


def config_dirs(recipe: Path | None) -> list[Path]:
    """Where group files are looked up, first match wins."""
    dirs: list[Path] = []
    env = os.environ.get("PD_CONFIG_PATH")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    if recipe is not None:
        dirs += [recipe.parent / "configs", recipe.parent.parent / "configs"]
    dirs += [Path.cwd() / "configs", REPO_CONFIGS]
    seen: list[Path] = []
    for d in dirs:
        d = d.resolve()
        if d not in seen and d.is_dir():
            seen.append(d)
    return seen


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    if not path.exists():
        raise UserError(f"{what} not found: {path}", hint="check the path (relative to the current directory)")
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.yaml"))
        raise UserError(
            f"{what} {path} is a directory, not a YAML file",
            hint=f"pass one file, e.g. {path / inside[0]} (in it: {', '.join(inside)})" if inside
            else "pass a YAML file, e.g. recipes/quickstart.yaml",
        )
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}{where}: malformed YAML: {problem}", hint="fix the YAML syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return data


def available_groups(group: str, dirs: list[Path]) -> list[str]:
    names = {p.stem for d in dirs for p in (d / group).glob("*.yaml")}
    return sorted(names)


def _flatten(obj: Any, prefix: str = "") -> list[str]:
    if isinstance(obj, dict) and obj:
        out: list[str] = []
        for k, v in obj.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix] if prefix else []


def _parse_defaults(entries: Any, origin: str, problems: list[str]) -> dict[str, str]:
    """`defaults: [{model: mlp}, {data: digits}]` (or `model: mlp` strings) -> {group: name}."""
    chosen: dict[str, str] = {}
    if entries is None:
        return chosen
    if not isinstance(entries, list):
        problems.append(f"{origin}: defaults: must be a list like [{{model: mlp}}, {{data: digits}}]")
        return chosen
    for entry in entries:
        if entry == "_self_":
            continue
        if isinstance(entry, str) and ":" in entry:
            group_name, _, choice_name = entry.partition(":")
            entry = {group_name.strip(): choice_name.strip()}
        if not isinstance(entry, dict) or len(entry) != 1:
            problems.append(f"{origin}: defaults: entry {entry!r} must be a single `group: name`")
            continue
        ((group, name),) = entry.items()
        if group not in GROUPS:
            close = difflib.get_close_matches(str(group), GROUPS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; groups are {', '.join(GROUPS)}"
            problems.append(f"{origin}: defaults: unknown group {group!r}{hint}")
            continue
        chosen[group] = str(name)
    return chosen


def _parse_overrides(overrides: list[str], problems: list[str]) -> tuple[dict[str, str], list[str]]:
    """-> (group selections, the other items in command-line order: `key=value` sets and
    `~key` deletes, so `~a a=1` sets a and `a=1 ~a` deletes it)."""
    groups: dict[str, str] = {}
    edits: list[str] = []
    for item in overrides:
        if item.startswith("~"):
            edits.append(item)
            continue
        if "=" not in item:
            problems.append(f"command line: {item!r} is not `key=value` (or `~key` to delete)")
            continue
        key, value = item.split("=", 1)
        if key in GROUPS and value and not value.startswith(("{", "[")):
            groups[key] = value
        else:
            edits.append(item)
    return groups, edits


def _apply_override(cfg: DictConfig, item: str, sources: dict[str, str], problems: list[str]) -> None:
    """Set `key=value` in `cfg` (OmegaConf's value grammar; a dict value merges), recording
    its source; an index past a list's end or a bad path is a problem, not a traceback."""
    key, text = item.split("=", 1)
    try:
        parsed: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))
        value = parsed["value"]
        _seed_lists_from_schema(cfg, key)
        OmegaConf.update(cfg, key, value, merge=True)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError, IndexError, KeyError) as e:
        problems.append(f"command line: {key}: cannot set it ({_first_line(e)}); "
                        "a list item is addressed by index, e.g. cluster.levels.0.devices=4")
        return
    for sub in _flatten(value, key) or [key]:
        sources[sub] = COMMAND_LINE


def _seed_lists_from_schema(cfg: DictConfig, key: str) -> None:
    """Before `a.b.0.c=...`, copy the schema's default list `a.b` when no layer set it."""
    parts = key.split(".")
    for i, part in enumerate(parts[1:], start=1):
        parent = ".".join(parts[:i])
        if part.isdigit() and OmegaConf.select(cfg, parent) is None:
            default = OmegaConf.select(OmegaConf.structured(Config), parent)
            if default is not None:
                OmegaConf.update(cfg, parent, OmegaConf.to_container(default), merge=False)
            return


def _delete(cfg: DictConfig, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node: Any = cfg
    for p in parents:
        if not isinstance(node, DictConfig) or p not in node:
            return False
        node = node[p]
    if isinstance(node, DictConfig) and leaf in node:
        del node[leaf]
        return True
    return False


def load_config(recipe: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> Loaded:
    """Compose, override, validate and resolve a config. Raises ConfigError with every problem."""
    overrides = list(overrides or [])
    problems: list[str] = []
    recipe_path = Path(recipe) if recipe is not None else None
    body: dict[str, Any] = {}
    if recipe_path is not None:
        body = read_yaml(recipe_path, "recipe")
    dirs = config_dirs(recipe_path)
    origin = str(recipe_path) if recipe_path else "recipe"

    chosen = _parse_defaults(body.pop("defaults", None), origin, problems)
    cli_groups, edits = _parse_overrides(overrides, problems)
    chosen.update(cli_groups)

    layers: list[tuple[str, dict[str, Any]]] = []
    for group, name in chosen.items():
        path = next((d / group / f"{name}.yaml" for d in dirs if (d / group / f"{name}.yaml").exists()), None)
        if path is None:
            names = available_groups(group, dirs)
            close = difflib.get_close_matches(name, names, n=2)
            fix = f"did you mean {' or '.join(close)}?" if close else f"available: {', '.join(names) or 'none'}"
            where = COMMAND_LINE if group in cli_groups else origin
            problems.append(f"{where}: {group}: no config group file {group}/{name}.yaml ({fix})")
            continue
        layers.append((str(path), {group: read_yaml(path, f"{group} config")}))
    layers.append((origin, body))

    sources: dict[str, str] = {}
    merged: Any = OmegaConf.create({})
    for label, layer in layers:
        for key in _flatten(layer):
            sources[key] = label
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(layer))
        except OmegaConfBaseException as e:
            problems.append(f"{label}: {e}")
    for item in edits:  # last, one by one: `cluster.levels.0.devices=3` indexes into the list
        if not item.startswith("~"):
            _apply_override(merged, item, sources, problems)
            continue
        key = item[1:].split("=", 1)[0]
        if not _delete(merged, key):
            problems.append(f"command line: ~{key}: no such key to delete")
        sources = {k: v for k, v in sources.items() if k != key and not k.startswith(key + ".")}

    try:
        notes = _cuts_over_stage_count(merged, sources)
        _auto_to_search(merged, sources)
    except OmegaConfBaseException as e:  # e.g. an interpolation to a key that is not there
        key = str(getattr(e, "full_key", "") or "?")
        raise ConfigError([*problems, f"{sources.get(key, origin)}: {key}: {_first_line(e)}"]) from None
    plain: Any = OmegaConf.to_container(merged, resolve=False)
    assert isinstance(plain, dict)
    problems += validate_tree(plain, Config, sources)
    if problems:
        raise ConfigError(problems, hint="`pd config show RECIPE` prints the resolved config once it loads")

    try:
        structured = OmegaConf.merge(OmegaConf.structured(Config), merged)
        config = OmegaConf.to_object(structured)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "?"
        raise ConfigError([f"{sources.get(str(key), origin)}: {key}: {_first_line(e)}"]) from None
    assert isinstance(config, Config)
    file_problem = _read_schedule_file(config, recipe_path)
    value_problems = [_with_source(p, sources, origin) for p in check_values(config)]
    if value_problems:
        raise ConfigError(value_problems + ([file_problem.message] if file_problem else []))
    if file_problem:
        raise file_problem
    return Loaded(config=config, sources=sources, recipe=recipe_path, notes=notes)


def _read_schedule_file(config: Config, recipe: Path | None) -> UserError | None:
    """A hand-written schedule (`schedule.name: file`): `schedule.path` read into `schedule.orders`
    (when null; relative to the current directory, else to the recipe's) and the lines checked
    (`pdcli.schedule.handwritten`); what is wrong, if anything."""
    schedule = config.schedule
    if schedule.name not in SCHEDULES or not rules(schedule.name).hand_written:
        return None
    if schedule.orders is None and schedule.path is not None:
        given = Path(schedule.path).expanduser()
        tried = [given] if given.is_absolute() else [Path.cwd() / given, *([recipe.parent / given] if recipe else [])]
        found = next((p for p in tried if p.is_file()), None)
        if found is None:
            return UserError(f"schedule.path: {schedule.path} not found (looked for {', '.join(map(str, tried))})",
                             hint="give the schedule file's path, relative to the current directory or the recipe")
        try:
            schedule.orders = device_lines(found.read_text())
        except (OSError, UnicodeDecodeError) as e:
            return UserError(f"schedule.path: cannot read {found} ({e})")
    if schedule.orders is None or schedule.num_microbatches < 1:
        return None  # check_values names what is missing
    source = schedule.path or "schedule.orders"
    try:
        orders = check_lines(schedule.orders, schedule.num_microbatches, schedule.split_backward_on, source)
    except UserError as e:
        return e
    merge_problem = written_merge_problem(orders, source) if schedule.merge_weight_grads else None
    return UserError(f"schedule.merge_weight_grads: {merge_problem}") if merge_problem else None


CUT_KEYS = ("plan.split_points", "plan.boundaries")


def _cuts_over_stage_count(merged: Any, sources: dict[str, str]) -> list[str]:
    """Cuts fixed on the command line outrank a stage count a file set: when `plan.split_points`
    or `plan.boundaries` from the command line make more stages than the recipe's
    `plan.num_stages`, that count is dropped (the cuts give it) and a note says so. A count set
    on the command line too stays, and the planner reports the conflict."""
    num_stages = OmegaConf.select(merged, "plan.num_stages")
    if not isinstance(num_stages, int) or sources.get("plan.num_stages") == COMMAND_LINE:
        return []
    for key in CUT_KEYS:
        cuts = OmegaConf.select(merged, key)
        from_command_line = any(k == key or k.startswith(key + ".") for k, v in sources.items() if v == COMMAND_LINE)
        if from_command_line and (OmegaConf.is_list(cuts) or isinstance(cuts, list)) and len(cuts) + 1 > num_stages:
            del merged.plan["num_stages"]
            origin = sources.pop("plan.num_stages", "the recipe")
            return [f"{key} makes {len(cuts) + 1} stages: {origin}'s plan.num_stages: {num_stages} is not used"]
    return []


AUTO = "auto"
AUTO_STAND_IN_MICROBATCHES = 4
"""`schedule.num_microbatches: auto` profiles with the largest divisor of the minibatch up to this."""


def _auto_to_search(merged: Any, sources: dict[str, str]) -> None:
    """`schedule.name: auto`, `schedule.num_microbatches: auto` and `train.recompute: auto` hand the
    field to the planner (`train.precision: auto` too): it joins `plan.search`, and the field takes
    a stand-in value the profile's runtime probe runs with (pipedream; the largest divisor of the
    minibatch up to AUTO_STAND_IN_MICROBATCHES; no recompute; fp32).
    `pd plan` picks the value; `pd train` runs the plan's."""
    searched = [str(key) for key in OmegaConf.select(merged, "plan.search", default=None) or []]
    batch = OmegaConf.select(merged, "data.batch_size", default=None)
    stand_ins = {
        "schedule.name": PIPEDREAM,
        "schedule.num_microbatches": max((m for m in range(1, AUTO_STAND_IN_MICROBATCHES + 1)
                                          if isinstance(batch, int) and batch > 0 and batch % m == 0), default=1),
        "train.recompute": False,
        "train.precision": "fp32",
    }
    for key, stand_in in stand_ins.items():
        if OmegaConf.select(merged, key, default=None) != AUTO:
            continue
        OmegaConf.update(merged, key, stand_in, merge=False)
        if key not in searched:
            searched.append(key)
            sources.setdefault("plan.search", sources.get(key, "recipe"))
    if searched:
        OmegaConf.update(merged, "plan.search", searched, merge=False)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]


def _with_source(problem: str, sources: dict[str, str], origin: str) -> str:
    key = problem.split(":", 1)[0]
    return f"{sources.get(key, 'defaults')}: {problem}"


def load_resolved(path: str | os.PathLike[str]) -> Config:
    """Load a resolved `config.yaml` written to a run directory (workers use this)."""
    return load_config(path).config


def run_dir_path(cfg: Config) -> Path:
    return Path(cfg.run.root) / cfg.run.name
