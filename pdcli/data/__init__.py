"""Data set registry: synthetic sets, scikit-learn's digits, and user tensor/token files."""

from pdcli.data.batch import Batch
from pdcli.data.registry import DATASETS, build_data, list_datasets
from pdcli.data.source import BatchSource

__all__ = ["Batch", "BatchSource", "DATASETS", "build_data", "list_datasets"]
