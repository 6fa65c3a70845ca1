"""The compiler: stages chained by their manifest equal the model, forward and backward."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pdcli.compiler import CompileVerificationError, compile_stages, load_stage, split_graph, verify_stages
from pdcli.compiler.ctor import constructor_source
from pdcli.compiler.load import tied_holders
from pdcli.config.schema import Config, DataConfig, ModelConfig, ScheduleConfig
from pdcli.errors import UserError
from pdcli.models import MODELS, build_model
from pdcli.profiler.trace import chain_order, trace_model
from pdcli.rundir import RunDir
from pdcli.steps.compile import ensure_stages


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only adds contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- small models -------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(6, 6), nn.ReLU())], nn.Linear(6, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SkipModel(nn.Module):
    """`a`'s output is added after `c`: with cuts after a, b it skips over two boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.out(self.c(torch.tanh(self.b(h))) + h)


class BatchNormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.drop(F.relu(self.bn(self.conv(x)))), 1))


class TwoInputs(nn.Module):
    """Two inputs, an int from x.size(0) used two stages later, an LSTM's tuple output cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.scale = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        n = x.size(0)
        h = F.relu(self.a(x))
        width = h.size(1)  # h reaches the last stage anyway: recomputed there, not sent
        halves = torch.chunk(h, 2, dim=1)  # a tuple of tensors, used whole two stages later
        seq = self.lstm(h.unsqueeze(1))
        z = self.b(seq[0].squeeze(1)) * self.scale + y
        return self.out(z.reshape(n, width) + h * torch.cat(halves, 1))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(torch.relu(self.mid(self.shared(x))))


class FunctionalWeights(nn.Module):
    """A parameter and buffers read functionally (get_attr), one non-persistent, a tensor constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]), persistent=False)
        self.sub = nn.Module()
        self.sub.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu((self.a(x) * self.mask) @ self.w) + torch.tensor([0.5, 0.25, 0.0, 1.0])
        return h * self.sub.scale


class Attention(nn.Module):
    """torch.nn's attention layers are fx leaves: rebuilt from their constructor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.2)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True, activation="gelu")
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        attended = self.mha(h, h, h)  # (output, weights): the tuple crosses the cut
        return self.head(self.layer(attended[0] + h))


def _positions(model: nn.Module) -> list[str]:
    return [n.name for n in chain_order(trace_model(model))]


def _cuts(model: nn.Module, *after: str) -> list[tuple[int, int]]:
    """Stage boundaries that cut right after the named chain nodes."""
    names = _positions(model)
    ends = [names.index(a) + 1 for a in after] + [len(names)]
    return list(zip([0, *ends[:-1]], ends))


def _even(num_positions: int, num_stages: int) -> list[tuple[int, int]]:
    b = [round(i * num_positions / num_stages) for i in range(num_stages + 1)]
    return list(zip(b, b[1:]))


SMALL: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Tensor, ...]], tuple[str, ...]]] = {
    "mlp": (MLP, lambda: (torch.randn(3, 6),), ("layers_1", "layers_4")),
    "skip": (SkipModel, lambda: (torch.randn(3, 4),), ("tanh", "tanh_1")),
    "batchnorm": (BatchNormModel, lambda: (torch.randn(3, 2, 4, 4),), ("conv", "relu")),
    "inplace_after_cut": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)),
        lambda: (torch.randn(3, 4),),
        ("_0",),
    ),
    "attention": (Attention, lambda: (torch.randn(3, 5, 4),), ("mha",)),
    "functional_weights": (FunctionalWeights, lambda: (torch.randn(3, 4),), ("mul",)),
    "two_inputs": (TwoInputs, lambda: (torch.randn(3, 4), torch.randn(3, 4)), ("relu", "lstm", "mul")),
}


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("train", [True, False])
def test_small_models_match_forward_and_backward(name: str, train: bool, tmp_path: Path) -> None:
    make, inputs, cuts = SMALL[name]
    torch.manual_seed(0)
    model = make().train(train)
    manifest, report = compile_stages(model, inputs(), _cuts(model, *cuts), tmp_path)
    assert manifest["num_stages"] == len(cuts) + 1
    assert report.num_tensors_checked >= sum(1 for _ in model.parameters())
    assert report.output_max_abs_error < 1e-5 and report.grad_max_abs_error < 1e-5


def test_skip_over_two_boundaries_is_sent_directly(tmp_path: Path) -> None:
    model = SkipModel()
    manifest, _ = compile_stages(model, (torch.randn(3, 4),), _cuts(model, "tanh", "tanh_1"), tmp_path)
    s0, s1, s2 = manifest["stages"]
    assert [(o["name"], o["peers"]) for o in s0["outputs"]] == [("tanh", [1, 2])]
    assert [(i["name"], i["peer"]) for i in s1["inputs"]] == [("tanh", 0)]
    assert [o["name"] for o in s1["outputs"]] == ["tanh_1"]  # stage 1 does not relay `tanh`
    assert sorted((i["name"], i["peer"]) for i in s2["inputs"]) == [("tanh", 0), ("tanh_1", 1)]
    assert s2["outputs"] == [{"name": "output", "shape": [3, 2], "dtype": "float32", "peers": ["loss"]}]
    assert s0["inputs"] == [{"name": "x", "shape": [3, 4], "dtype": "float32", "peer": "data"}]
    assert manifest["microbatch_size"] == 3 and manifest["model_inputs"] == ["x"]


def test_non_tensor_values_are_recomputed_or_baked_never_sent(tmp_path: Path) -> None:
    model = TwoInputs()
    inputs = (torch.randn(3, 4), torch.randn(3, 4))
    parts = split_graph(trace_model(model), _cuts(model, "relu", "lstm", "mul"), inputs)
    wires = {i.wire.name for p in parts for i in p.inputs} | {o.wire.name for p in parts for o in p.outputs}
    assert not {"size", "size_1"} & wires
    assert "size" in parts[3].baked  # x.size(0): x never reaches stage 3
    assert "size_1" in parts[3].recomputed  # h.size(1): h is sent to stage 3 anyway
    sent_by_1 = {o.wire.name: o.peers for o in parts[1].outputs}
    assert sent_by_1 == {"chunk__0": (3,), "chunk__1": (3,), "lstm__0": (2,)}  # not the LSTM's (h, c)
    source = (compile_stages(model, inputs, _cuts(model, "relu", "lstm", "mul"), tmp_path), tmp_path / "stage_3.py")[1]
    assert "reshape(3, size_1)" in source.read_text()  # the baked batch size, the recomputed width
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    inputs_of = [[(i["name"], i["peer"]) for i in st["inputs"]] for st in manifest["stages"]]
    assert inputs_of[0] == [("x", "data")] and ("y", "data") in inputs_of[3]  # read where used


def test_weights_are_keyed_by_original_names(tmp_path: Path) -> None:
    model = BatchNormModel()
    manifest, _ = compile_stages(model, (torch.randn(3, 2, 4, 4),), _cuts(model, "conv", "relu"), tmp_path)
    saved: dict[str, Tensor] = {}
    for entry in manifest["stages"]:
        saved |= torch.load(tmp_path / entry["weights"], weights_only=True)
        assert set(entry["param_names"].values()) <= set(saved)
    assert set(saved) == set(model.state_dict())  # running stats included, nothing extra
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name
    module, entry = load_stage(tmp_path, 1)
    assert entry["stage_id"] == 1 and torch.equal(module.bn.running_var, model.bn.running_var)


def test_functional_weights_keep_their_names_and_persistence(tmp_path: Path) -> None:
    model = FunctionalWeights()
    compile_stages(model, (torch.randn(3, 4),), _cuts(model, "mul"), tmp_path)
    (s0, _), (s1, _) = load_stage(tmp_path, 0), load_stage(tmp_path, 1)
    assert set(s0.state_dict()) | set(s1.state_dict()) == set(model.state_dict())  # no extra keys
    assert torch.equal(s0.mask, model.mask) and torch.equal(s1.w, model.w)  # mask: non-persistent
    assert torch.equal(s1.sub.scale, model.sub.scale)
    assert [n for n, _ in s1.named_parameters()] == ["w"]


LAYERS = [
    nn.Conv2d(3, 4, 3, stride=2, bias=False, padding_mode="reflect", padding=1),
    nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1),
    nn.BatchNorm1d(4, momentum=None, affine=False),
    nn.LayerNorm([4, 5], elementwise_affine=False),
    nn.GroupNorm(2, 4),
    nn.Embedding(10, 4, padding_idx=0),
    nn.EmbeddingBag(10, 4, mode="sum"),
    nn.LSTM(4, 5, num_layers=2, bidirectional=True, dropout=0.1, proj_size=3),
    nn.GRU(4, 5, bias=False),
    nn.RNN(4, 5, nonlinearity="relu"),
    nn.MultiheadAttention(8, 2, kdim=4, vdim=6, add_bias_kv=True),
    nn.GELU("tanh"),
    nn.MaxPool2d(3, 2, ceil_mode=True),
    nn.Unflatten(1, (2, 2)),
    nn.TransformerDecoderLayer(8, 2, 16, norm_first=True),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda m: type(m).__name__)
def test_layers_are_rebuilt_from_constructor_arguments(layer: nn.Module) -> None:
    source = constructor_source(layer)  # raises if the rebuilt layer differs
    rebuilt = eval(source, {"torch": torch})  # noqa: S307
    assert type(rebuilt) is type(layer) and repr(rebuilt) == repr(layer)


def test_a_layer_that_cannot_be_rebuilt_is_a_user_error() -> None:
    with pytest.raises(UserError, match="custom activation"):
        constructor_source(nn.TransformerEncoderLayer(8, 2, 16, activation=nn.SiLU()))


def test_tampered_weights_fail_verification_naming_the_stage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    inputs = (torch.randn(3, 6),)
    compile_stages(model, inputs, _cuts(model, "layers_1", "layers_4"), tmp_path)
    weights = torch.load(tmp_path / "stage_1.pt", weights_only=True)
    weights["layers.2.weight"] += 0.1
    torch.save(weights, tmp_path / "stage_1.pt")
    with pytest.raises(CompileVerificationError) as info:
        verify_stages(model, inputs, tmp_path)
    assert info.value.stage_id == 1 and info.value.max_abs_error > 1e-3
    assert not isinstance(info.value, UserError)


def test_a_lost_gradient_fails_verification_at_the_last_stage_it_reaches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    inputs = (torch.randn(3, 6),)
    compile_stages(model, inputs, _cuts(model, "layers_1", "layers_4"), tmp_path)
    path = tmp_path / "stage_2.py"
    source, count = re.subn(r"def forward\(self, (\w+)\):", r"\g<0>\n        \1 = \1.detach()", path.read_text())
    assert count == 1
    path.write_text(source)  # same forward values; stages 0 and 1 get no gradient
    with pytest.raises(CompileVerificationError, match="gradients") as info:
        verify_stages(model, inputs, tmp_path)
    assert info.value.stage_id == 1  # in backward order, stage 1 is the first one wrong


def test_tied_weights_within_a_stage_stay_tied_and_across_stages_are_held_by_both(tmp_path: Path) -> None:
    model = Tied()
    inputs = (torch.randn(3, 4),)
    manifest, _ = compile_stages(model, inputs, [(0, len(_positions(model)))], tmp_path / "one")
    module, _ = load_stage(tmp_path / "one", 0)
    assert module.shared.weight is not None and len(list(module.parameters())) == 4  # 2 x Linear, tied
    assert tied_holders(manifest) == []
    # A layer called in two stages: each holds a copy; verification sums their gradients.
    manifest, _ = compile_stages(model, inputs, _cuts(model, "mid"), tmp_path / "two")
    assert tied_holders(manifest) == [{0: "shared.weight", 1: "shared.weight"}, {0: "shared.bias", 1: "shared.bias"}]


@pytest.mark.parametrize("bad", ["gap", "short", "empty"])
def test_bad_boundaries_are_user_errors(bad: str, tmp_path: Path) -> None:
    model = MLP()
    n = len(_positions(model))
    boundaries = {"gap": [(0, 2), (3, n)], "short": [(0, 2), (2, n - 1)], "empty": [(0, 0), (0, n)]}[bad]
    with pytest.raises(UserError, match="chain position"):
        compile_stages(model, (torch.randn(3, 6),), boundaries, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_generated_files_import_and_run_in_a_fresh_interpreter(tmp_path: Path) -> None:
    model = TwoInputs()
    compile_stages(model, (torch.randn(3, 4), torch.randn(3, 4)), _cuts(model, "relu", "lstm", "mul"), tmp_path)
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys, torch
        d = {str(tmp_path)!r}
        manifest = json.load(open(d + "/manifest.json"))
        assert "pdcli" not in sys.modules
        for entry in manifest["stages"]:
            spec = importlib.util.spec_from_file_location("s", d + "/" + entry["module"])
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            stage = mod.build()
            assert type(stage).__name__ == entry["class_name"]
            weights = torch.load(d + "/" + entry["weights"], weights_only=True)
            stage.load_state_dict({{k: weights[v] for k, v in entry["param_names"].items()}})
            ins = [torch.zeros(i["shape"], dtype=getattr(torch, i["dtype"])) for i in entry["inputs"]]
            outs = stage(*ins)
            assert isinstance(outs, tuple) and [list(o.shape) for o in outs] == [o["shape"] for o in entry["outputs"]]
        print("ok", len(manifest["stages"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-B", "-c", script], capture_output=True, text=True, timeout=50, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "4"]


# -- the built-in model zoo ------------------------------------------------------------------
TOKENS = 11
TINY: dict[str, tuple[dict[str, Any], Callable[[], tuple[Tensor, ...]]]] = {
    "mlp": ({"in_features": 8, "hidden": 16, "num_layers": 3, "num_classes": 4}, lambda: (torch.randn(2, 8),)),
    "vgg16": (
        {"width": 1 / 16, "image_size": 32, "num_classes": 4, "fc_hidden": 16, "batch_norm": True, "dropout": 0.5},
        lambda: (torch.randn(2, 3, 32, 32),),
    ),
    "resnet18": ({"width": 2, "image_size": 8, "num_classes": 4}, lambda: (torch.randn(2, 3, 8, 8),)),
    "resnet50": ({"width": 2, "image_size": 8, "num_classes": 4}, lambda: (torch.randn(2, 3, 8, 8),)),
    "alexnet": (
        {"width": 1 / 16, "image_size": 32, "num_classes": 4, "fc_hidden": 16, "dropout": 0.5},
        lambda: (torch.randn(2, 3, 32, 32),),
    ),
    "gnmt": (
        {"vocab_size": TOKENS, "hidden": 8, "num_layers": 3},
        lambda: (torch.randint(0, TOKENS, (2, 5)), torch.randint(0, TOKENS, (2, 4))),
    ),
    "gpt": (
        {"vocab_size": TOKENS, "max_seq_len": 8, "dim": 8, "num_layers": 2, "num_heads": 2, "mlp_ratio": 2},
        lambda: (torch.randint(0, TOKENS, (2, 6)),),
    ),
    "inception": ({"width": 2, "image_size": 8, "num_classes": 4}, lambda: (torch.randn(2, 3, 8, 8),)),
}


def test_every_built_in_model_has_a_tiny_size_here() -> None:
    assert set(TINY) == set(MODELS)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(TINY))
def test_zoo_models_split_evenly_match_the_model(name: str, num_stages: int, tmp_path: Path) -> None:
    kwargs, inputs = TINY[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, kwargs=kwargs))
    boundaries = _even(len(_positions(model)), num_stages)
    manifest, report = compile_stages(model, inputs(), boundaries, tmp_path)
    assert manifest["num_stages"] == num_stages
    assert report.num_tensors_checked >= len(list(model.parameters()))
    saved: set[str] = set()
    for entry in manifest["stages"]:
        saved |= set(torch.load(tmp_path / entry["weights"], weights_only=True))
    assert saved == set(model.state_dict())  # every weight lands in exactly the stages' union


# -- the `pd compile` step ---------------------------------------------------------------------
def _config() -> Config:
    return Config(
        model=ModelConfig(name="mlp", kwargs={"in_features": 16, "hidden": 8, "num_layers": 3, "num_classes": 4}),
        data=DataConfig(name="synthetic_images", kwargs={"channels": 1, "image_size": 4, "num_classes": 4}, batch_size=8),
        schedule=ScheduleConfig(name="1f1b", num_microbatches=2),
    )


def _plan(*ends: int) -> dict[str, Any]:
    starts = [0, *ends[:-1]]
    return {"version": 1, "stages": [{"stage_id": k, "start": s, "end": e} for k, (s, e) in enumerate(zip(starts, ends))]}


def test_ensure_stages_reuses_until_the_plan_changes(tmp_path: Path) -> None:
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    n = len(_positions(build_model(cfg.model)))
    manifest, reused = ensure_stages(cfg, run, _plan(4, n))
    assert not reused and manifest["num_stages"] == 2 and manifest["microbatch_size"] == 4
    assert manifest["stages"][0]["inputs"][0]["shape"] == [4, 1, 4, 4]
    written = (run / "stages" / "stage_0.py").stat().st_mtime_ns

    again, reused = ensure_stages(cfg, run, _plan(4, n))
    assert reused and again == manifest
    assert (run / "stages" / "stage_0.py").stat().st_mtime_ns == written
    load_stage(run / "stages", 1)  # loading (no __pycache__) must not alter the artifact
    assert ensure_stages(cfg, run, _plan(4, n))[1]

    three, reused = ensure_stages(cfg, run, _plan(2, 5, n))
    assert not reused and three["num_stages"] == 3
    assert not (run / "stages" / "stage_3.py").exists()
    assert ensure_stages(cfg, run, _plan(2, 5, n))[1]
    assert not ensure_stages(cfg, run, _plan(2, 5, n), force=True)[1]
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_ensure_stages_refuses_edited_stages_and_stale_plans(tmp_path: Path) -> None:
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    ensure_stages(cfg, run, _plan(4, 8))
    path = run / "stages" / "stage_0.py"
    path.write_text(path.read_text() + "\n# edited\n")
    with pytest.raises(UserError, match="changed after it was written"):
        ensure_stages(cfg, run, _plan(4, 8))
    stale = _plan(4, 8)
    stale["stages"][0]["node_names"] = ["not", "this", "model", "s"]
    with pytest.raises(UserError, match="node_names"):
        ensure_stages(cfg, run, stale, force=True)
