"""Registry helpers shared by models and data: name look-up, kwarg checks, `module:attr` import."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from typing import Any, Callable, Mapping

from pdcli.errors import UserError


def close_matches(word: str, choices: list[str], max_matches: int = 3) -> list[str]:
    """Up to `max_matches` entries of `choices` that look like `word` (difflib)."""
    return difflib.get_close_matches(word, choices, n=max_matches, cutoff=0.5)


def lookup(registry: Mapping[str, Callable[..., Any]], name: str, key: str, what: str) -> Callable[..., Any]:
    """`registry[name]`, or a UserError that names `key`, close matches and all names."""
    if name in registry:
        return registry[name]
    available = sorted(registry)
    matches = close_matches(name, available)
    guess = f"; did you mean {' or '.join(matches)}?" if matches else ""
    raise UserError(
        f"{key}: unknown {what} {name!r}{guess}",
        hint=f"available: {', '.join(available)}",
    )


def accepted_kwargs(factory: Callable[..., Any]) -> list[str] | None:
    """Names of the keyword arguments `factory` accepts; None when it takes `**kwargs`."""
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], key: str, owner: str) -> None:
    """Reject kwargs that `factory` does not take, all at once, with a guess for each.

    `key` is the config key holding the kwargs (`model.kwargs`), `owner` the factory's
    name as the user wrote it (`mlp`).
    """
    accepted = accepted_kwargs(factory)
    if accepted is None:
        return
    problems = []
    for name in kwargs:
        if name in accepted:
            continue
        matches = close_matches(str(name), accepted)
        guess = f"; did you mean {' or '.join(matches)}?" if matches else ""
        problems.append(f"{key}.{name}: unknown argument of {owner}{guess}")
    if problems:
        raise UserError(
            "\n".join(problems),
            hint=f"{owner} accepts: {', '.join(accepted) if accepted else '(no arguments)'}",
        )


def import_target(target: str, key: str) -> Callable[..., Any]:
    """Import `package.module:attr` and return the attribute (a callable).

    The current directory is put on `sys.path` first, so a factory in a file next to
    the recipe can be named without installing it.
    """
    module_name, sep, attr_name = target.partition(":")
    if not sep or not module_name or not attr_name:
        raise UserError(
            f"{key}: {target!r} must look like `package.module:factory`",
            hint="e.g. model.target=mymodels:make_net (mymodels.py in the current directory)",
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserError(
            f"{key}: cannot import module {module_name!r} of {target!r} ({exc})",
            hint="check the spelling, install the package, or run pd from the directory "
            "that holds the module (or add it to PYTHONPATH)",
        ) from exc
    except ImportError as exc:
        raise UserError(f"{key}: importing {module_name!r} failed: {exc}") from exc
    if not hasattr(module, attr_name):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        matches = close_matches(attr_name, names)
        guess = f"; did you mean {' or '.join(matches)}?" if matches else ""
        raise UserError(
            f"{key}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
            f"has no attribute {attr_name!r}{guess}",
            hint=f"callables in {module_name}: {', '.join(sorted(names)) or '(none)'}",
        )
    attr = getattr(module, attr_name)
    if not callable(attr):
        raise UserError(f"{key}: {target!r} is a {type(attr).__name__}, not a callable factory")
    return attr


def call_factory(factory: Callable[..., Any], kwargs: Mapping[str, Any], key: str, owner: str) -> Any:
    """`factory(**kwargs)` for a user's factory: whatever it raises becomes a UserError naming
    `key` (`model.target`) and `owner` (`pkg.mod:fn`); `pd --debug` keeps the traceback."""
    try:
        return factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
        reason = " ".join(str(exc).split()) or "(no message)"
        raise UserError(
            f"{key}: {owner}(**{dict(kwargs)!r}) raised {type(exc).__name__}: {reason}",
            hint=f"fix the factory or its arguments; `pd --debug ...` shows where {owner} raised",
        ) from exc


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def check_kwarg_types(factory: Callable[..., Any], kwargs: Mapping[str, Any], key: str) -> None:
    """Reject kwargs whose type differs from the default's (int, float, bool, str), all at once.

    Only for built-in factories, whose defaults are the documented types; an argument
    with default None is not checked.
    """
    params = inspect.signature(factory).parameters
    problems = []
    for name, value in kwargs.items():
        param = params.get(name)
        if param is None or param.default is inspect.Parameter.empty or param.default is None:
            continue
        if not _type_ok(value, param.default):
            problems.append(
                f"{key}.{name}: expected {type(param.default).__name__} "
                f"(like the default {param.default!r}), got {type(value).__name__} {value!r}"
            )
    if problems:
        raise UserError("\n".join(problems))
