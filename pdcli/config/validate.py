"""Check a composed (plain) config tree against the schema, collecting every problem."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _source(sources: dict[str, str], key: str) -> str:
    """The file that set `key` (or its closest parent key)."""
    probe = key
    while probe:
        if probe in sources:
            return sources[probe]
        matches = [v for k, v in sources.items() if k.startswith(probe + ".")]
        if matches:
            return matches[-1]
        probe = probe.rpartition(".")[0]
    return "defaults"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin in (list, typing.List):
        return "a list"
    if origin in (dict, typing.Dict):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _groups_with_field(name: str) -> list[str]:
    """Top-level groups whose dataclass has a field `name` (for `train.lr` -> `optim.lr`)."""
    from pdcli.config.schema import Config

    groups = []
    for group in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[group.name]
        if dataclasses.is_dataclass(tp) and name in {f.name for f in dataclasses.fields(tp)}:
            groups.append(group.name)
    return groups


def validate_tree(tree: dict[str, Any], cls: Any, sources: dict[str, str], prefix: str = "") -> list[str]:
    """Unknown keys (with close matches), wrong types and `???` values under `prefix`."""
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            elsewhere = _groups_with_field(str(key)) if prefix and not close else []
            if close:
                fix = f"did you mean {prefix}{close[0]}?"
            elif elsewhere:
                fix = f"did you mean {' or '.join(f'{g}.{key}' for g in elsewhere)}?"
            else:
                fix = f"known keys: {', '.join(names)}"
            problems.append(f"{_source(sources, dotted)}: {dotted}: unknown key ({fix})")
            continue
        tp: Any = _unwrap_optional(hints[key])
        if value == "???":
            problems.append(
                f"{_source(sources, dotted)}: {dotted}: missing required value; "
                f"set it in the recipe or on the command line as {dotted}=..."
            )
            continue
        if value is None or _is_interpolation(value):
            continue
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{_source(sources, dotted)}: {dotted}: expected a mapping, got {value!r}")
            else:
                problems += validate_tree(value, tp, sources, dotted + ".")
            continue
        if typing.get_origin(tp) in (list, typing.List):
            (item_tp,) = typing.get_args(tp)
            if not isinstance(value, list):
                problems.append(f"{_source(sources, dotted)}: {dotted}: expected a list, got {value!r}")
            elif dataclasses.is_dataclass(item_tp):
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        problems += validate_tree(item, item_tp, sources, f"{dotted}.{i}.")
                    else:
                        problems.append(f"{_source(sources, dotted)}: {dotted}.{i}: expected a mapping, got {item!r}")
            continue
        try:
            OmegaConf.merge(OmegaConf.structured(cls), {key: value})
        except OmegaConfBaseException:
            problems.append(
                f"{_source(sources, dotted)}: {dotted}: expected {_type_name(hints[key])}, got {value!r}"
            )
    return problems
