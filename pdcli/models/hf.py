"""Hugging Face `transformers` causal LMs built from a model type plus config overrides (`model.hf`).

Random weights from torch's global RNG, nothing fetched from the hub: the model is made by
`AutoModelForCausalLM.from_config` from the type's own config class. `use_cache` is off (the
pipeline trains; a key/value cache is an extra output no stage needs); the model's output
object is reduced to its `logits` where it is traced or called (`pdcli.models.loss.logits_of`).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from torch import nn

from pdcli.errors import UserError
from pdcli.models.factory import close_matches

INSTALL_COMMAND = "pip install 'pd[hf]'   (or: pip install transformers)"
"""How to get the optional `transformers` dependency (the `hf` extra of pyproject.toml)."""


def import_transformers() -> Any:
    """The `transformers` module, or a UserError with the install command when it is missing."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise UserError(
            f"model.hf needs the `transformers` package, which cannot be imported ({exc})",
            hint=f"install it: {INSTALL_COMMAND}",
        ) from None


def hf_config(model_type: str, overrides: Mapping[str, Any]) -> Any:
    """The `transformers` config of `model_type` with `overrides` applied and `use_cache` off.

    Config classes accept any keyword silently, so a key the type's default config does not
    have is refused here (a typo such as `n_layers` would otherwise build the default depth).
    """
    transformers = import_transformers()
    mapping = transformers.CONFIG_MAPPING
    types = sorted(mapping.keys())
    if model_type not in mapping:
        matches = close_matches(model_type, types)
        guess = f"; did you mean {' or '.join(matches)}?" if matches else ""
        raise UserError(
            f"model.hf: unknown transformers model type {model_type!r}{guess}",
            hint="a `model_type` of transformers' CONFIG_MAPPING, e.g. gpt2, llama, mistral, qwen2, bert",
        )
    config_class = mapping[model_type]
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))  # + aliases: hidden_size of GPT-2
    problems = []
    for key in overrides:
        if key in known:
            continue
        matches = close_matches(str(key), sorted(known))
        guess = f"; did you mean {' or '.join(matches)}?" if matches else ""
        problems.append(f"model.kwargs.{key}: not a field of transformers' {config_class.__name__}{guess}")
    if problems:
        raise UserError("\n".join(problems), hint=f"model.kwargs of model.hf={model_type} override fields of {config_class.__name__}")
    try:
        config = config_class(**{**overrides, "use_cache": False})
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.kwargs: {config_class.__name__} refuses them: {exc}") from None
    return config


def build_hf(model_type: str, overrides: Mapping[str, Any]) -> nn.Module:
    """The causal LM of `model_type` (`gpt2`, `llama`, ...) with random weights, in train mode."""
    config = hf_config(model_type, overrides)
    transformers = import_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # a type without a causal-LM head
        raise UserError(f"model.hf: {model_type!r} has no causal-LM model in transformers: {' '.join(str(exc).split())[:300]}") from None
    model.config.use_cache = False
    return model.train()
