"""Profiler: exact sizes of known layers, cuts across skips, timing sanity, the profile step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcli.config.schema import (
    Config, DataConfig, ModelConfig, OptimConfig, ProfileConfig, RunConfig, ScheduleConfig,
)
from pdcli.errors import UserError
from pdcli.profiler.chain import Chain
from pdcli.profiler.clock import Clock
from pdcli.torchutil.threads import torch_threads
from pdcli.profiler.measure import profile_model
from pdcli.profiler.optim_cost import OptimizerCost, OptimizerFactory, measure_optimizer
from pdcli.profiler.summary import format_bytes, summarize
from pdcli.rundir import RunDir
from pdcli.steps.profile import ensure_profile
from pdcli.torchutil.optim import build_optimizer

FLOAT32_BYTES = 4
INT64_BYTES = 8
BATCH = 8
FAST = dict(warmup=1, repeats=2, progress=False)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # One intra-op thread, as a CPU worker on this 2-core machine gets; keeps the tests fast.
    with torch_threads(1):
        yield


def batch_of(*inputs: torch.Tensor, target: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(inputs=inputs, target=target)


def by_name(chain: Chain) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(chain.nodes)}


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """stem -> a -> act -> b -> (+ stem output) -> head: the stem output skips three positions."""

    HIDDEN = 32

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, self.HIDDEN)
        self.a = nn.Linear(self.HIDDEN, self.HIDDEN)
        self.act = nn.ReLU()
        self.b = nn.Linear(self.HIDDEN, self.HIDDEN)
        self.head = nn.Linear(self.HIDDEN, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.b(self.act(self.a(h))) + h)


class InputSkip(nn.Module):
    """The model input is consumed again by the last op: it crosses every cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


def test_linear_sizes_are_exact() -> None:
    chain = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    assert [n.name for n in chain.nodes] == ["fc1", "act", "fc2"]
    fc1, act, fc2 = chain.nodes
    assert fc1.parameter_bytes == (64 * 128 + 128) * FLOAT32_BYTES
    assert fc1.activation_bytes == BATCH * 128 * FLOAT32_BYTES
    assert act.parameter_bytes == 0 and act.activation_bytes == BATCH * 128 * FLOAT32_BYTES
    assert fc2.parameter_bytes == (128 * 10 + 10) * FLOAT32_BYTES
    assert fc2.activation_bytes == BATCH * 10 * FLOAT32_BYTES
    # fc2 saves its input for the weight gradient; its weight is not counted (always alive).
    assert fc2.backward_memory_bytes == BATCH * 128 * FLOAT32_BYTES
    assert chain.cut_bytes == (BATCH * 128 * FLOAT32_BYTES, BATCH * 128 * FLOAT32_BYTES)
    assert chain.input_bytes == BATCH * 64 * FLOAT32_BYTES
    assert all(n.fwd_ms > 0 and n.bwd_ms > 0 for n in chain.nodes)


def test_cuts_carry_the_skip_connection() -> None:
    chain = profile_model(Residual(), batch_of(torch.randn(BATCH, 16), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    assert [n.name for n in chain.nodes] == ["stem", "a", "act", "b", "add", "head"]
    hidden_bytes = BATCH * Residual.HIDDEN * FLOAT32_BYTES
    # After stem: h. After a / act / b: that output and h (the skip). After add: its output.
    assert chain.cut_bytes == (hidden_bytes, 2 * hidden_bytes, 2 * hidden_bytes, 2 * hidden_bytes, hidden_bytes)
    assert sum(n.parameter_bytes for n in chain.nodes) == param_bytes(Residual())


def test_model_input_consumed_late_crosses_every_cut() -> None:
    chain = profile_model(InputSkip(), batch_of(torch.randn(BATCH, 16), target=torch.randn(BATCH, 16)),
                          F.mse_loss, "cpu", **FAST)  # fmt: skip
    x_bytes = BATCH * 16 * FLOAT32_BYTES
    assert [n.name for n in chain.nodes] == ["a", "b", "add"]
    assert chain.cut_bytes == (2 * x_bytes, 2 * x_bytes)
    assert chain.input_bytes == x_bytes
    # The input does not require grad in training: `a` computes no input gradient, but still
    # has a backward (its weight gradient).
    assert chain.nodes[0].bwd_ms > 0


class TiedLstm(nn.Module):
    """Embedding -> LSTM (tuple output) -> logits through the embedding's own weight; an argmax."""

    def __init__(self, vocab: int = 50, hidden: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(self.emb(tokens))
        logits = F.linear(out + h.transpose(0, 1), self.emb.weight)
        guess = logits.argmax(-1)  # integer output: no backward
        return logits + self.emb(guess).sum()


def test_tuple_outputs_integer_outputs_and_tied_weights() -> None:
    vocab, hidden, seq_len = 50, 24, 5
    tokens = torch.randint(0, vocab, (BATCH, seq_len))
    model = TiedLstm(vocab, hidden)
    chain = profile_model(model, batch_of(tokens, target=torch.randn(BATCH, seq_len, vocab)),
                          F.mse_loss, "cpu", **FAST)  # fmt: skip
    pos = by_name(chain)
    lstm = chain.nodes[pos["lstm"]]
    assert lstm.activation_bytes == (BATCH * seq_len * hidden + 2 * BATCH * hidden) * FLOAT32_BYTES
    assert lstm.bwd_ms > 0 and lstm.backward_memory_bytes > 0
    argmax = chain.nodes[pos["argmax"]]
    assert argmax.bwd_ms == 0 and argmax.activation_bytes == BATCH * seq_len * INT64_BYTES
    assert chain.nodes[pos["getitem"]].bwd_ms == 0  # picks from the tuple: nothing to differentiate
    # The embedding weight is used three times (emb, F.linear via get_attr, emb again) but owned once.
    assert sum(n.parameter_bytes for n in chain.nodes) == param_bytes(model)
    assert chain.nodes[pos["emb"]].parameter_bytes == vocab * hidden * FLOAT32_BYTES
    # Right after the LSTM, its whole (out, (h, c)) tuple crosses the cut.
    assert chain.cut_bytes[pos["lstm"]] == lstm.activation_bytes
    assert chain.input_bytes == BATCH * seq_len * INT64_BYTES


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x).mul_(2.0))


def test_inplace_ops_are_measured_on_copies() -> None:
    chain = profile_model(InPlace(), batch_of(torch.randn(BATCH, 16), target=torch.randn(BATCH, 16)),
                          F.mse_loss, "cpu", **FAST)  # fmt: skip
    assert [n.name for n in chain.nodes] == ["fc", "mul_", "act"]
    assert all(n.bwd_ms > 0 for n in chain.nodes)


def test_calibration_and_meta_are_recorded() -> None:
    chain = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST, config_hash="abc", model_name="two")  # fmt: skip
    calibration = chain.meta["calibration"]
    assert calibration["step_ms"] > 0
    assert calibration["sum_node_ms"] == pytest.approx(sum(n.fwd_ms + n.bwd_ms for n in chain.nodes))
    assert calibration["ratio"] == pytest.approx(calibration["step_ms"] / calibration["sum_node_ms"])
    meta = chain.meta
    assert (meta["model"], meta["config_hash"], meta["batch_size"], meta["dtype"]) == ("two", "abc", BATCH, "float32")
    assert meta["created_by"] == "pd profile" and meta["torch_version"] == torch.__version__
    assert (meta["warmup"], meta["repeats"], meta["num_threads"]) == (1, 2, 1)
    assert meta["device"]


def sgd(momentum: float = 0.0) -> OptimizerFactory:
    return lambda module: build_optimizer(OptimConfig(name="sgd", momentum=momentum), module)


def test_optimizer_step_is_measured_per_position() -> None:
    chain = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST, optimizer_factory=sgd(), optimizer_name="sgd")  # fmt: skip
    fc1, act, fc2 = chain.nodes
    assert fc1.optimizer_ms > 0 and fc2.optimizer_ms > 0
    assert act.optimizer_ms == 0 and act.optimizer_state_bytes == 0
    assert fc1.optimizer_state_bytes == 0  # plain SGD keeps no state
    meta = chain.meta["optimizer"]
    assert meta["name"] == "sgd" and meta["step_overhead_ms"] > 0
    assert meta["sum_node_ms"] == pytest.approx(fc1.optimizer_ms + fc2.optimizer_ms)
    without = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                            F.cross_entropy, "cpu", **FAST)  # fmt: skip
    assert all(n.optimizer_ms == 0 for n in without.nodes) and "optimizer" not in without.meta


@pytest.mark.parametrize(("optim", "state_per_param_byte"), [
    (OptimConfig(name="sgd"), 0), (OptimConfig(name="sgd", momentum=0.9), 1),
    (OptimConfig(name="adam"), 2), (OptimConfig(name="adamw", weight_decay=0.01), 2),
])
def test_optimizer_state_bytes_per_optimizer(optim: OptimConfig, state_per_param_byte: int) -> None:
    model = TwoLayer()
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.fc1.parameters())
    cost = measure_optimizer(params, lambda m: build_optimizer(optim, m), Clock(torch.device("cpu")), 1, 2)
    assert cost.step_ms > 0
    assert cost.state_bytes == state_per_param_byte * param_bytes(model.fc1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # stepped on copies
    assert measure_optimizer([], lambda m: build_optimizer(optim, m), Clock(torch.device("cpu")), 1, 2) == (
        OptimizerCost(0.0, 0))


def test_profiles_without_optimizer_fields_still_load() -> None:
    chain = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    obj = chain.to_json()
    for node in obj["nodes"]:
        del node["optimizer_ms"], node["optimizer_state_bytes"]
    old = Chain.from_json(json.loads(json.dumps(obj)))
    assert [n.optimizer_ms for n in old.nodes] == [0.0] * 3 and [n.fwd_ms for n in old.nodes] == [n.fwd_ms for n in chain.nodes]


class Frozen(nn.Module):
    """A Linear layer, a frozen one, an attention block that reads its projection weights
    directly, and a leaf block that runs two Linear layers through their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.fc(x)).unsqueeze(1)
        return self.block(self.attn(h, h, h)[0]).squeeze(1)


def test_weight_grads_are_timed_on_linear_positions_only() -> None:
    model = TwoLayer()
    chain = profile_model(model, batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    fc1, act, fc2 = chain.nodes
    for linear in (fc1, fc2):
        assert 0 < linear.wgrad_ms < float("inf")
        assert linear.wgrad_ms <= linear.bwd_ms  # a part of the backward, never more
    assert act.wgrad_ms == 0.0
    assert all("forward" not in vars(m) for m in model.modules())  # the split-backward patch is gone
    assert all(p.grad is None for p in model.parameters())
    assert "weight grads" in summarize(chain)
    residual = profile_model(Residual(), batch_of(torch.randn(BATCH, 16), target=torch.randint(0, 10, (BATCH,))),
                             F.cross_entropy, "cpu", **FAST)  # fmt: skip
    assert [n.name for n in residual.nodes if n.wgrad_ms > 0] == ["stem", "a", "b", "head"]
    assert all(n.wgrad_ms == 0.0 for n in residual.nodes if n.name in ("act", "add"))


def test_frozen_linears_and_attention_defer_no_weight_grads() -> None:
    chain = profile_model(Frozen(), batch_of(torch.randn(BATCH, 16), target=torch.randn(BATCH, 16)),
                          F.mse_loss, "cpu", **FAST)  # fmt: skip
    wgrad = {n.name: n.wgrad_ms for n in chain.nodes}
    assert wgrad["fc"] > 0 and wgrad["block"] > 0  # the block's feed-forward Linears defer, as at run time
    assert wgrad["frozen"] == 0.0 and wgrad["attn"] == 0.0  # attention reads out_proj.weight itself: nothing deferred
    assert chain.nodes[by_name(chain)["attn"]].bwd_ms > 0


def test_profiles_without_weight_grads_still_load() -> None:
    chain = profile_model(TwoLayer(), batch_of(torch.randn(BATCH, 64), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    obj = chain.to_json()
    assert obj["version"] == 1 and all(node["wgrad_ms"] == n.wgrad_ms for node, n in zip(obj["nodes"], chain.nodes))
    for node in obj["nodes"]:
        del node["wgrad_ms"]
    old = Chain.from_json(json.loads(json.dumps(obj)))
    assert [n.wgrad_ms for n in old.nodes] == [0.0] * 3 and [n.bwd_ms for n in old.nodes] == [n.bwd_ms for n in chain.nodes]


def test_profile_round_trips_through_json() -> None:
    chain = profile_model(Residual(), batch_of(torch.randn(BATCH, 16), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST)  # fmt: skip
    assert Chain.from_json(json.loads(json.dumps(chain.to_json()))) == chain


def test_summary_lists_the_costliest_layers_and_totals() -> None:
    chain = profile_model(Residual(), batch_of(torch.randn(BATCH, 16), target=torch.randint(0, 10, (BATCH,))),
                          F.cross_entropy, "cpu", **FAST, optimizer_factory=sgd(momentum=0.9),
                          optimizer_name="sgd")  # fmt: skip
    costliest = max(chain.nodes, key=lambda n: n.fwd_ms + n.bwd_ms)
    text = summarize(chain, top=2)
    assert costliest.label.split(" -> ")[0][:40] in text
    assert "positions     6" in text and "top 2 of 6" in text
    assert format_bytes(sum(n.parameter_bytes for n in chain.nodes)) in text
    assert f"= {chain.meta['calibration']['ratio']:.2f} x" in text
    state = sum(n.optimizer_state_bytes for n in chain.nodes)
    assert state == sum(n.parameter_bytes for n in chain.nodes)  # momentum: one buffer per parameter
    assert "(sgd; fixed cost" in text and f"state {format_bytes(state)}" in text
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


# -- the model zoo ---------------------------------------------------------------------------

def test_resnet18_cut_spans_the_residual_block() -> None:
    from pdcli.models import build_loss, build_model

    model = build_model(ModelConfig(name="resnet18", kwargs={"width": 8, "image_size": 16, "num_classes": 10}))
    shapes: dict[str, torch.Size] = {}

    def record(key: str, tensor: torch.Tensor) -> None:
        shapes[key] = tensor.shape

    block = model.layer1[1]  # identity shortcut: its input x waits for the add
    hooks = [
        block.register_forward_pre_hook(lambda m, args: record("x", args[0])),
        block.conv1.register_forward_hook(lambda m, args, out: record("conv1", out)),
        block.bn2.register_forward_hook(lambda m, args, out: record("bn2", out)),
    ]
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model(images)
    for hook in hooks:
        hook.remove()
    chain = profile_model(model, batch_of(images, target=torch.randint(0, 10, (2,))),
                          build_loss("cross_entropy"), "cpu", **FAST)  # fmt: skip

    def nbytes(shape: torch.Size) -> int:
        return shape.numel() * FLOAT32_BYTES

    pos = by_name(chain)
    assert chain.cut_bytes[pos["layer1_1_conv1"]] == nbytes(shapes["conv1"]) + nbytes(shapes["x"])
    assert chain.cut_bytes[pos["layer1_1_bn2"]] == nbytes(shapes["bn2"]) + nbytes(shapes["x"])
    assert sum(n.parameter_bytes for n in chain.nodes) == param_bytes(model)
    assert all(n.fwd_ms > 0 for n in chain.nodes)


def test_gnmt_with_lstm_tuples_profiles() -> None:
    from pdcli.data import build_data
    from pdcli.models import build_loss, build_model

    model = build_model(ModelConfig(name="gnmt", kwargs={"vocab_size": 32, "hidden": 16, "num_layers": 2}))
    batch = build_data(DataConfig(name="synthetic_seq2seq", kwargs={"vocab_size": 32, "seq_len": 6}), 4).batch(0)
    chain = profile_model(model, batch, build_loss("cross_entropy"), "cpu", **FAST)
    lstms = [n for n in chain.nodes if "LSTM" in n.label]
    assert lstms and all(n.activation_bytes > 0 and n.bwd_ms > 0 for n in lstms)
    assert chain.input_bytes == 2 * 4 * 6 * INT64_BYTES
    assert len(chain.cut_bytes) == len(chain) - 1 and min(chain.cut_bytes) > 0
    assert sum(n.parameter_bytes for n in chain.nodes) == param_bytes(model)


# -- the profile step ------------------------------------------------------------------------

def small_config(tmp_path: Path) -> Config:
    return Config(
        model=ModelConfig(name="mlp", kwargs={"in_features": 48, "hidden": 32, "num_layers": 2}),
        data=DataConfig(name="synthetic_images", kwargs={"channels": 3, "image_size": 4}, batch_size=8),
        schedule=ScheduleConfig(num_microbatches=2),
        profile=ProfileConfig(warmup=1, repeats=2, device="cpu"),
        run=RunConfig(name="t", root=str(tmp_path / "runs")),
    )


@pytest.mark.slow
def test_ensure_profile_reuses_until_inputs_change(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    run = RunDir(Path(cfg.run.root) / cfg.run.name)
    chain, reused = ensure_profile(cfg, run)
    assert not reused and (run / "profile.json").exists()
    assert chain.meta["batch_size"] == cfg.microbatch_size == 4
    assert chain.meta["host_speed_ms"] > 0  # the host's speed as the layers were timed (`pd report` compares a run's)
    assert Chain.from_json(json.loads((run / "profile.json").read_text())) == chain

    again, reused = ensure_profile(cfg, run)
    assert reused and again == chain

    _, reused = ensure_profile(cfg, run, force=True)
    assert not reused

    changed = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, batch_size=2))
    remeasured, reused = ensure_profile(changed, run)
    assert not reused and remeasured.meta["batch_size"] == 2
    assert remeasured.nodes[1].activation_bytes == 2 * 32 * FLOAT32_BYTES  # first Linear, at batch 2
    assert remeasured.meta["config_hash"] != chain.meta["config_hash"]

    adam = dataclasses.replace(changed, optim=OptimConfig(name="adam"))
    with_adam, reused = ensure_profile(adam, run)  # the optimizer is an input
    assert not reused and with_adam.meta["optimizer"]["name"] == "adam"
    first_linear = with_adam.nodes[1]
    assert first_linear.optimizer_ms > 0 and first_linear.optimizer_state_bytes == 2 * first_linear.parameter_bytes


def test_host_speed_times_the_reference_matmul_on_one_thread_and_restores_the_threads() -> None:
    from pdcli.host import HOST_SPEED_SHAPE, host_speed_ms

    before = torch.get_num_threads()
    seen: list[int] = []
    real_mm = torch.mm

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        assert (a.shape[0], a.shape[1], b.shape[1]) == HOST_SPEED_SHAPE
        return real_mm(a, b)

    torch.mm = mm  # type: ignore[assignment]
    try:
        ms = host_speed_ms(seconds=0.02)
    finally:
        torch.mm = real_mm  # type: ignore[assignment]
    assert ms > 0 and len(seen) >= 8 and set(seen) == {1}  # 3 warm-up calls, then at least 5 timed
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_ensure_profile_refuses_a_hand_edited_profile(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    run = RunDir(Path(cfg.run.root) / cfg.run.name)
    ensure_profile(cfg, run)
    (run / "profile.json").write_text((run / "profile.json").read_text().replace('"fwd_ms"', '"fwd_ms" ', 1))
    with pytest.raises(UserError, match="changed after it was written"):
        ensure_profile(cfg, run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_without_cuda_is_a_user_error(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, device="cuda"))
    with pytest.raises(UserError, match="profile.device"):
        ensure_profile(cfg, RunDir(tmp_path / "r"))


def test_median_ms_runs_setup_outside_every_call_and_takes_the_median() -> None:
    from pdcli.profiler.clock import Clock, median_ms

    calls: list[str] = []
    result = median_ms(Clock(torch.device("cpu")), lambda: calls.append("work"), warmup=2, repeats=3,
                       setup=lambda: calls.append("setup"))  # fmt: skip
    assert calls == ["setup", "work"] * 5
    assert result >= 0
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        median_ms(Clock(torch.device("cpu")), lambda: None, warmup=0, repeats=0)


def test_profile_threads_follow_the_worker_share(tmp_path: Path) -> None:
    from pdcli.probe.profile import cpu_threads_per_worker, profile_device

    cfg = small_config(tmp_path)
    assert profile_device(cfg) == torch.device("cpu")
    pinned = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads_per_worker=3))
    assert cpu_threads_per_worker(pinned) == 3
    assert cpu_threads_per_worker(cfg) >= 1
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
