"""Graph capture: torch.fx first, torch.export where fx cannot trace, one clear error when neither can."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdcli.compiler import load_stage
from pdcli.compiler.build import compile_stages
from pdcli.errors import UserError
from pdcli.profiler.trace import chain_order, trace_model


class ShapeBranch(nn.Module):
    """Python control flow on a shape: fx cannot trace it, torch.export specializes it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if x.shape[0] > 1:
            h = h + torch.relu(self.b(h))
        return self.c(h)


class ValueBranch(ShapeBranch):
    """Control flow on a tensor's value: neither fx nor export can trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.c(self.b(h))


def test_fx_first() -> None:
    gm = trace_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert [n.op for n in chain_order(gm)] == ["call_module", "call_module"]


def test_export_fallback_matches_the_model() -> None:
    torch.manual_seed(0)
    model, x = ShapeBranch(), torch.randn(5, 8)
    with pytest.raises(UserError, match="torch.fx cannot trace ShapeBranch"):
        trace_model(model)  # without example inputs there is nothing to export with
    gm = trace_model(model, (x,))
    assert torch.allclose(gm(x), model(x))
    assert len(chain_order(gm)) >= 5  # ATen ops: linear, relu, linear, relu, add, linear
    assert not any("guards" in str(n.target) for n in gm.graph.nodes)
    gm.eval()  # the profiler and compiler switch modes; an ExportedProgram module refuses
    gm.train()


def test_neither_can_trace_names_both() -> None:
    with pytest.raises(UserError) as info:
        trace_model(ValueBranch(), (torch.randn(5, 8),))
    assert "torch.fx cannot trace ValueBranch" in info.value.message
    assert "torch.export cannot either" in info.value.message


def test_exported_graph_compiles_into_verified_stages(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = ShapeBranch(), torch.randn(4, 8)
    n = len(chain_order(trace_model(model, (x,))))
    manifest, _ = compile_stages(model, (x,), [(0, n // 2), (n // 2, n)], tmp_path)  # verifies fwd + bwd
    assert manifest["num_stages"] == 2
    stage0, entry = load_stage(tmp_path, 0)
    assert {"a.weight", "a.bias"} <= set(dict(stage0.named_parameters()))  # original names kept
    outs = stage0(x)
    assert [tuple(o.shape) for o in outs] == [tuple(w["shape"]) for w in entry["outputs"]]
