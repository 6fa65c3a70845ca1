"""pd: PipeDream-style pipeline-parallel training for PyTorch."""

__version__ = "0.1.0"
