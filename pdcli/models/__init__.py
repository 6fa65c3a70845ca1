"""Model registry: built-in reference models (random init, no downloads) and user factories."""

from pdcli.models.loss import LOSSES, LossFn, build_loss, logits_of
from pdcli.models.registry import MODELS, build_model, list_models

__all__ = ["LOSSES", "LossFn", "MODELS", "build_loss", "logits_of", "build_model", "list_models"]
