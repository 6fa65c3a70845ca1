"""The compiler: split a traced model by a plan into one generated module per stage."""

from pdcli.compiler.build import compile_stages
from pdcli.compiler.load import load_stage, read_manifest
from pdcli.compiler.split import StagePart, split_graph
from pdcli.compiler.verify import CompileVerificationError, VerificationReport, verify_stages

__all__ = [
    "CompileVerificationError",
    "StagePart",
    "VerificationReport",
    "compile_stages",
    "load_stage",
    "read_manifest",
    "split_graph",
    "verify_stages",
]
