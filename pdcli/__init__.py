"""pd: PipeDream-style pipeline-parallel training for PyTorch."""

from pdcli.markers import pipe_split

__version__ = "0.1.0"
__all__ = ["pipe_split"]
