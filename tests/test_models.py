"""Model registry: every built-in model builds, traces with torch.fx, trains a step; user factories; errors."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import yaml

from pdcli.config.schema import DataConfig, ModelConfig
from pdcli.data import build_data
from pdcli.errors import UserError
from pdcli.models import LOSSES, MODELS, build_loss, build_model, list_models, logits_of

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# Tiny size of each built-in model and the data set (name, kwargs) that feeds it.
TINY: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "mlp": ({"in_features": 64, "hidden": 16, "num_layers": 3}, "digits", {}),
    "vgg16": (
        {"width": 0.0625, "image_size": 32, "num_classes": 10, "fc_hidden": 16},
        "synthetic_images",
        {"image_size": 32},
    ),
    "resnet18": ({"width": 4, "image_size": 16, "num_classes": 10}, "synthetic_images", {"image_size": 16}),
    "resnet50": ({"width": 4, "image_size": 16, "num_classes": 10}, "synthetic_images", {"image_size": 16}),
    "alexnet": (
        {"width": 0.0625, "image_size": 32, "num_classes": 10, "fc_hidden": 16},
        "synthetic_images",
        {"image_size": 32},
    ),
    "gnmt": ({"vocab_size": 20, "hidden": 16, "num_layers": 3}, "synthetic_seq2seq", {"vocab_size": 20, "seq_len": 6}),
    "gpt": (
        {"vocab_size": 20, "max_seq_len": 16, "dim": 16, "num_layers": 2, "num_heads": 2},
        "synthetic_tokens",
        {"vocab_size": 20, "seq_len": 12},
    ),
    "inception": ({"width": 4, "image_size": 16, "num_classes": 10}, "synthetic_images", {"image_size": 16}),
}

# Which data config group feeds each model config group.
PAIRS = {
    "mlp": "digits",
    "vgg16": "synthetic_images",
    "resnet18": "synthetic_images",
    "resnet50": "synthetic_images",
    "alexnet": "synthetic_images",
    "gnmt": "synthetic_seq2seq",
    "gpt": "synthetic_tokens",
    "inception": "synthetic_images",
    "hf_gpt2": "token_file",
    "hf_llama": "token_file",
}


def tiny(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    model_kwargs, data_name, data_kwargs = TINY[name]
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name=name, kwargs=model_kwargs))
    batch = build_data(DataConfig(name=data_name, kwargs=data_kwargs), batch_size=4).batch(0)
    return model, batch.inputs, batch.target


def test_every_builtin_model_has_a_tiny_test_size() -> None:
    assert set(TINY) == set(MODELS)
    assert set(PAIRS) == set(MODELS) | {p.stem for p in (CONFIGS / "model").glob("hf_*.yaml")}


def test_list_models_has_a_one_line_doc_per_model() -> None:
    listed = list_models()
    assert [name for name, _ in listed] == list(MODELS)
    for name, doc in listed:
        assert doc and "\n" not in doc, name


@pytest.mark.parametrize("name", sorted(TINY))
def test_builtin_model_traces_and_traced_module_matches(name: str) -> None:
    model, inputs, _ = tiny(name)
    model.eval()  # BatchNorm uses running stats: both calls see the same numbers
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        expected = model(*inputs)
        got = traced(*inputs)
    assert isinstance(got, torch.Tensor)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs)


@pytest.mark.parametrize("name", sorted(TINY))
def test_builtin_model_forward_backward_on_its_data(name: str) -> None:
    model, inputs, target = tiny(name)
    model.train()
    logits = model(*inputs)
    assert logits.shape[:-1] == target.shape
    loss = build_loss("cross_entropy")(logits, target)
    assert torch.isfinite(loss)
    loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{name}.{param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name}.{param_name} has a non-finite gradient"


@pytest.mark.parametrize("name", ["mlp", "resnet18", "gpt"])
def test_init_is_deterministic_given_the_seed(name: str) -> None:
    a, _, _ = tiny(name, seed=3)
    b, _, _ = tiny(name, seed=3)
    c, _, _ = tiny(name, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_gnmt_and_gpt_logits_have_sequence_shape() -> None:
    model, (src, tgt_in), target = tiny("gnmt")
    assert model(src, tgt_in).shape == (4, 6, 20)
    model, (tokens,), target = tiny("gpt")
    assert model(tokens).shape == (4, 12, 20)


def test_gpt_is_causal() -> None:
    model, (tokens,), _ = tiny("gpt")
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_resnet_has_skip_connections_in_the_graph() -> None:
    model, _, _ = tiny("resnet18")
    traced = torch.fx.symbolic_trace(model)
    adds = [n for n in traced.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert len(adds) == 8  # one per BasicBlock


def test_inception_blocks_concatenate_four_branches_of_one_input() -> None:
    model, _, _ = tiny("inception")
    traced = torch.fx.symbolic_trace(model)
    cats = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == 4  # one per block (num_blocks=4)
    for cat in cats:
        branches = cat.args[0]
        assert len(branches) == 4

        def source(node: torch.fx.Node) -> torch.fx.Node:  # walk up a branch to where it forks
            while len(node.all_input_nodes) == 1 and len(node.all_input_nodes[0].users) == 1:
                node = node.all_input_nodes[0]
            return node.all_input_nodes[0]

        assert len({source(b) for b in branches}) == 1  # the four branches start at the block's input


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("resnet18", {"width": 2, "image_size": 64, "num_classes": 5}),
        ("resnet50", {"width": 2, "image_size": 64, "num_classes": 5}),
        ("alexnet", {"width": 0.0625, "image_size": 64, "num_classes": 5, "fc_hidden": 8}),
        ("vgg16", {"width": 0.0625, "image_size": 64, "num_classes": 5, "fc_hidden": 8, "batch_norm": True}),
        ("inception", {"width": 2, "image_size": 64, "num_classes": 5}),
    ],
)
def test_image_models_with_the_large_image_stem(name: str, kwargs: dict[str, Any]) -> None:
    model = build_model(ModelConfig(name=name, kwargs=kwargs))
    images = torch.randn(2, 3, 64, 64)
    traced = torch.fx.symbolic_trace(model.eval())
    with torch.no_grad():
        assert model(images).shape == (2, 5)
        torch.testing.assert_close(traced(images), model(images))
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first_conv.stride[0] > 1 or name == "vgg16"  # ImageNet stems downsample at once


@pytest.mark.parametrize("model_file", sorted((CONFIGS / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_config_group_builds_and_fits_its_data(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(**yaml.safe_load(model_file.read_text()))
    if cfg.hf is not None:
        pytest.importorskip("transformers")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(CONFIGS.parent)  # data paths are relative to the repository root
    data_cfg = DataConfig(**yaml.safe_load((CONFIGS / "data" / f"{PAIRS[model_file.stem]}.yaml").read_text()))
    torch.manual_seed(0)
    model = build_model(cfg)
    batch = build_data(data_cfg, batch_size=2).batch(0)
    loss = build_loss(cfg.loss)(logits_of(model(*batch.inputs)), batch.target)
    assert torch.isfinite(loss)


def test_every_builtin_model_has_a_config_group() -> None:
    assert {p.stem for p in (CONFIGS / "model").glob("*.yaml")} >= set(MODELS)


# --- user factories -------------------------------------------------------------


def write_module(directory: Path, source: str) -> str:
    """A uniquely named module in `directory`; returns its name."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return name


USER_SOURCE = """
    import torch

    def make_net(width: int = 4, depth: int = 2):
        layers = [torch.nn.Linear(3, width)]
        layers += [torch.nn.Linear(width, width) for _ in range(depth - 1)]
        return torch.nn.Sequential(*layers)

    def not_a_module():
        return 42

    def broken(width: int = 4):
        raise ValueError(f"width {width} is too small")

    CONSTANT = 1
"""


def test_user_factory_by_target_gets_kwargs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = write_module(tmp_path, USER_SOURCE)
    model = build_model(ModelConfig(target=f"{module}:make_net", kwargs={"width": 7, "depth": 3}))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 and linears[-1].out_features == 7


def test_user_factory_is_found_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = write_module(tmp_path, USER_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # undo the insertion afterwards
    assert isinstance(build_model(ModelConfig(target=f"{module}:make_net")), torch.nn.Sequential)


def test_user_factory_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = write_module(tmp_path, USER_SOURCE)
    with pytest.raises(UserError, match=r"model.kwargs.widht: unknown argument of .*make_net; did you mean width\?"):
        build_model(ModelConfig(target=f"{module}:make_net", kwargs={"widht": 3}))
    with pytest.raises(UserError, match=r"model.target: .* has no attribute 'make_nett'; did you mean make_net\?"):
        build_model(ModelConfig(target=f"{module}:make_nett"))
    with pytest.raises(UserError, match=r"model.target: cannot import module 'no_such_module_xyz'"):
        build_model(ModelConfig(target="no_such_module_xyz:make"))
    with pytest.raises(UserError, match=r"returned a int, not a torch.nn.Module"):
        build_model(ModelConfig(target=f"{module}:not_a_module"))
    with pytest.raises(UserError, match=r"is a int, not a callable"):
        build_model(ModelConfig(target=f"{module}:CONSTANT"))
    with pytest.raises(UserError, match=r"must look like `package.module:factory`"):
        build_model(ModelConfig(target=f"{module}.make_net"))


def test_a_factory_that_raises_is_a_user_error_naming_model_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = write_module(tmp_path, USER_SOURCE)
    with pytest.raises(UserError, match=rf"model.target: {module}:broken\(\*\*{{'width': 2}}\) raised ValueError: width 2 is too small") as info:
        build_model(ModelConfig(target=f"{module}:broken", kwargs={"width": 2}))
    assert isinstance(info.value.__cause__, ValueError)  # `pd --debug` shows where it raised
    assert info.value.hint is not None and "--debug" in info.value.hint


# --- built-in errors ------------------------------------------------------------


def test_unknown_model_name_lists_close_matches_and_all_names() -> None:
    with pytest.raises(UserError) as info:
        build_model(ModelConfig(name="resnet51"))
    text = str(info.value)
    assert "model.name: unknown model 'resnet51'; did you mean" in text
    assert "resnet50" in text.splitlines()[0]
    assert all(name in info.value.hint for name in MODELS)


def test_unknown_kwarg_names_the_key_and_the_fix() -> None:
    with pytest.raises(UserError) as info:
        build_model(ModelConfig(name="mlp", kwargs={"hidden_size": 32, "num_layers": 2}))
    assert info.value.message == "model.kwargs.hidden_size: unknown argument of mlp; did you mean hidden?"
    assert "in_features" in info.value.hint


def test_bad_kwarg_type_and_value_are_user_errors() -> None:
    with pytest.raises(UserError, match=r"model.kwargs.hidden: expected int .* got str '32'"):
        build_model(ModelConfig(name="mlp", kwargs={"hidden": "32"}))
    with pytest.raises(UserError, match=r"model.kwargs: vgg16 image_size must be a multiple of 32, got 40"):
        build_model(ModelConfig(name="vgg16", kwargs={"image_size": 40}))
    with pytest.raises(UserError, match=r"not divisible by num_heads"):
        build_model(ModelConfig(name="gpt", kwargs={"dim": 10, "num_heads": 3}))


# --- losses ---------------------------------------------------------------------


def test_cross_entropy_flattens_sequence_logits() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.permute(0, 2, 1), target)
    torch.testing.assert_close(build_loss("cross_entropy")(logits, target), expected)
    flat_logits, flat_target = torch.randn(6, 3), torch.randint(0, 3, (6,))
    torch.testing.assert_close(
        build_loss("cross_entropy")(flat_logits, flat_target),
        torch.nn.functional.cross_entropy(flat_logits, flat_target),
    )


def test_mse_and_unknown_loss() -> None:
    out = torch.tensor([[1.0], [3.0]])
    assert build_loss("mse")(out, torch.tensor([0, 1])).item() == pytest.approx((1 + 4) / 2)
    assert set(LOSSES) == {"cross_entropy", "mse"}
    with pytest.raises(UserError, match=r"model.loss: unknown loss 'nll'"):
        build_loss("nll")
