"""Config: typed schema, composition of config groups, overrides and validation."""

from pdcli.config.loader import Loaded, load_config, load_resolved, run_dir_path
from pdcli.config.schema import Config

__all__ = ["Config", "Loaded", "load_config", "load_resolved", "run_dir_path"]
