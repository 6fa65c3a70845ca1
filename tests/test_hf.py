"""Hugging Face models (`model.hf`) and weights tied between stages.

The quick tests build `transformers` models from a config name (random weights, nothing
fetched: HF_HUB_OFFLINE=1), refuse bad names and overrides, fail with the install command
when `transformers` is missing, and compile a tied GPT-2 into two verified stages that both
hold the tied weight. The slow tests train it over 2 real processes and compare with
single-process training of the same `transformers` model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub
transformers = pytest.importorskip("transformers")

from pdcli.cli import app  # noqa: E402
from pdcli.compiler.build import compile_stages  # noqa: E402
from pdcli.compiler.load import tied_holders, with_tied_names  # noqa: E402
from pdcli.config import load_resolved  # noqa: E402
from pdcli.config.schema import Config, check_values  # noqa: E402
from pdcli.data import build_data  # noqa: E402
from pdcli.errors import UserError  # noqa: E402
from pdcli.models import build_loss, build_model  # noqa: E402
from pdcli.models.hf import INSTALL_COMMAND  # noqa: E402
from pdcli.profiler.trace import chain_order, trace_model  # noqa: E402
from pdcli.rundir import RunDir  # noqa: E402
from pdcli.runtime.checkpoint import load_model_state  # noqa: E402
from pdcli.runtime.job import run_training  # noqa: E402
from pdcli.runtime.tied import check_schedule  # noqa: E402
from pdcli.steps.compile import ensure_stages  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}
SEQ_LEN = 16
STEPS = 3
runner = CliRunner()


def hf_config(run_dir: Path, schedule: str, model_type: str = "gpt2", overrides: dict | None = None) -> Config:
    cfg = Config()
    cfg.model.hf, cfg.model.kwargs = model_type, dict(GPT2 if overrides is None else overrides)
    cfg.data.name = "synthetic_tokens"
    cfg.data.kwargs = {"vocab_size": 64, "seq_len": SEQ_LEN}
    cfg.data.batch_size = 8
    cfg.schedule.name, cfg.schedule.num_microbatches = schedule, 2
    cfg.optim.name, cfg.optim.lr, cfg.optim.momentum = "sgd", 0.2, 0.9
    cfg.train.steps, cfg.train.log_every, cfg.train.timeout_s, cfg.train.threads_per_worker = STEPS, 1, 60, 1
    cfg.run.root, cfg.run.name = str(run_dir.parent), run_dir.name
    return cfg


def two_stage_plan(cfg: Config, replicas: tuple[int, int] = (1, 1)) -> dict:
    """A plan that splits the model's chain in the middle: embedding on stage 0, LM head on stage 1."""
    torch.manual_seed(cfg.train.seed)
    sample = build_data(cfg.data, cfg.data.batch_size).batch(0).split(cfg.schedule.num_microbatches)[0]
    n = len(chain_order(trace_model(build_model(cfg.model), sample.inputs)))
    r0, r1 = replicas
    return {"version": 1, "inputs": {}, "pipeline": {}, "stages": [
        {"stage_id": 0, "start": 0, "end": n // 2, "replicas": r0, "ranks": list(range(r0))},
        {"stage_id": 1, "start": n // 2, "end": n, "replicas": r1, "ranks": list(range(r0, r0 + r1))}]}


def compiled_run(tmp_path: Path, schedule: str, replicas: tuple[int, int] = (1, 1),
                 clip: float | None = None) -> tuple[Config, RunDir, dict, dict]:
    """config.yaml, plan.json and stages/ of a 2-stage run (the real compile step)."""
    run_dir = tmp_path / "run"
    cfg = hf_config(run_dir, schedule)
    cfg.optim.clip_grad_norm = clip
    run = RunDir(run_dir)
    run.create()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    plan = two_stage_plan(cfg, replicas)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    manifest, _ = ensure_stages(cfg, run, plan)
    return cfg, run, plan, manifest


# ---- quick: building, bad input, compiling -------------------------------------------------------


def test_hf_model_is_built_from_a_config_name_with_random_tied_weights() -> None:
    cfg = Config()
    cfg.model.hf, cfg.model.kwargs = "gpt2", dict(GPT2)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.config.n_layer == 2
    assert model.config.use_cache is False
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them by default
    torch.manual_seed(0)
    again = build_model(cfg.model)
    torch.manual_seed(1)
    other = build_model(cfg.model)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded random init
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_hf_output_object_is_traced_down_to_its_logits() -> None:
    cfg = Config()
    cfg.model.hf, cfg.model.kwargs = "gpt2", dict(GPT2)
    model = build_model(cfg.model).eval()
    tokens = torch.randint(0, 64, (2, SEQ_LEN))
    gm = trace_model(model, [tokens])
    out = gm(tokens)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, model(tokens).logits)


def test_hf_bad_type_and_unknown_override_name_the_key() -> None:
    cfg = Config()
    cfg.model.hf = "gtp2"
    with pytest.raises(UserError, match=r"model.hf: unknown transformers model type 'gtp2'; did you mean gpt2"):
        build_model(cfg.model)
    cfg.model.hf, cfg.model.kwargs = "gpt2", {"n_layers": 2}
    with pytest.raises(UserError, match=r"model.kwargs.n_layers: not a field of transformers' GPT2Config; did you mean n_layer"):
        build_model(cfg.model)
    cfg.model.kwargs = {**{k: v for k, v in GPT2.items() if k != "n_layer"}, "num_hidden_layers": 1}  # GPT2Config's alias
    assert build_model(cfg.model).config.n_layer == 1


def test_hf_and_target_together_are_a_config_error() -> None:
    cfg = Config()
    cfg.model.hf, cfg.model.target = "gpt2", "mymodels:make_net"
    assert "model.hf: set either model.hf or model.target, not both (model.target=null or '~model.hf')" in check_values(cfg)


def test_missing_transformers_exits_2_with_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    result = runner.invoke(app, ["profile", str(REPO / "recipes/gpt2_hf.yaml"), f"run.root={tmp_path}",
                                 f"data.kwargs.path={REPO / 'recipes/data/text_bytes.bin'}"])
    assert result.exit_code == 2, result.output
    assert "model.hf needs the `transformers` package" in result.output and INSTALL_COMMAND in result.output
    assert "Traceback" not in result.output


def test_tied_gpt2_compiles_into_two_stages_that_both_hold_the_tie(tmp_path: Path) -> None:
    cfg = hf_config(tmp_path / "run", "1f1b")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    tokens = torch.randint(0, 64, (4, SEQ_LEN))
    n = len(chain_order(trace_model(model, [tokens])))
    manifest, report = compile_stages(model, [tokens], [(0, n // 2), (n // 2, n)], tmp_path)
    # verification passed: the holders' summed gradient is the model's gradient of the tied weight
    assert report.num_tensors_checked > 0
    (group,) = tied_holders(manifest)
    assert sorted(group) == [0, 1]
    (tied,) = manifest["tied_weights"]
    assert tied["names"] == ["lm_head.weight", "transformer.wte.weight"]
    stage_weights = [torch.load(tmp_path / f"stage_{k}.pt", weights_only=True) for k in (0, 1)]
    assert torch.equal(stage_weights[0][group[0]], stage_weights[1][group[1]])  # the copies start equal
    # every name of the tie comes back, and the model loads it strictly with the tie kept
    state = with_tied_names({k: v for w in stage_weights for k, v in w.items()}, manifest)
    fresh = build_model(cfg.model)
    fresh.load_state_dict(state, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_pipedream_refuses_a_weight_tied_between_stages_before_any_worker() -> None:
    manifest = {"tied_weights": [{"holders": {"0": "lm_head.weight", "1": "lm_head.weight"}, "names": []}]}
    with pytest.raises(UserError, match=r"schedule.name: pipedream cannot train a weight tied between stages "
                                        r"\(stage 0 as 'lm_head.weight', stage 1 as 'lm_head.weight'\)"):
        check_schedule(manifest, "pipedream")
    for schedule in ("1f1b", "gpipe", "2bw"):
        check_schedule(manifest, schedule)
    one_stage = {"tied_weights": [{"holders": {"0": "lm_head.weight"}, "names": ["a", "b"]}]}
    check_schedule(one_stage, "pipedream")  # a tie inside one stage is the stage's own business


# ---- slow: real processes against single-process training of the same model ---------------------


def single_process(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The `transformers` model (tie and all) trained in one process: gradients accumulated over
    the microbatches, one SGD step per minibatch. For `2bw` the gradient of minibatch t is taken
    on the weights before the previous step (W(t+1) = W(t) - lr * grad(W(t-1))), on a second
    instance of the model that holds those weights, tied as well."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    stale = build_model(cfg.model)
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    data, loss_fn, m = build_data(cfg.data, cfg.data.batch_size), build_loss("cross_entropy"), cfg.schedule.num_microbatches
    losses = []
    previous = {k: v.clone() for k, v in model.state_dict().items()}  # W(t-1), clamped at W(0)
    for t in range(STEPS):
        current = {k: v.clone() for k, v in model.state_dict().items()}
        on = model
        if cfg.schedule.name == "2bw":
            stale.load_state_dict(previous)
            on = stale
        for micro in data.batch(t).split(m):
            loss = loss_fn(on(*micro.inputs).logits, micro.target)
            (loss / m).backward()
            losses.append(float(loss.detach()))
        for p, q in zip(model.parameters(), on.parameters()):
            p.grad = q.grad
        if cfg.optim.clip_grad_norm is not None:  # the tied weight is one parameter: counted once
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        stale.zero_grad()
        previous = current
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,replicas,clip", [("1f1b", (1, 1), None), ("gpipe", (1, 1), None), ("2bw", (1, 1), None),
                                                    ("1f1b", (2, 1), None), ("1f1b", (1, 1), 0.05)],
                         ids=["1f1b", "gpipe", "2bw", "1f1b-replicated", "1f1b-clipped"])
def test_tied_gpt2_over_two_stages_equals_single_process_training(tmp_path: Path, schedule: str, replicas: tuple[int, int],
                                                                  clip: float | None) -> None:
    cfg, run, plan, manifest = compiled_run(tmp_path, schedule, replicas, clip)
    assert tied_holders(manifest)  # the tie crosses the split
    run_training(cfg, run, plan, manifest)
    summary = json.loads((run.path / "train" / "summary.json").read_text())
    losses = [summary["microbatch_losses"][str(i)] for i in range(STEPS * cfg.schedule.num_microbatches)]
    want_losses, want_weights = single_process(cfg)
    assert losses == pytest.approx(want_losses, abs=1e-5)
    assert losses[-1] < losses[0]
    exported = load_model_state(run.path / "train", STEPS)  # what `pd export` writes
    assert sorted(exported) == sorted(want_weights)
    for name, want in want_weights.items():
        torch.testing.assert_close(exported[name], want, atol=1e-5, rtol=1e-4, msg=name)
    model = build_model(cfg.model)
    model.load_state_dict(exported, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipedream_with_a_tie_between_stages_fails_before_launch(tmp_path: Path) -> None:
    cfg, run, plan, manifest = compiled_run(tmp_path, "pipedream")
    with pytest.raises(UserError, match="pipedream cannot train a weight tied between stages"):
        run_training(cfg, run, plan, manifest)
    assert not (run.path / "train" / "rank0.log").exists()  # no worker started


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt2_hf", "llama_hf"])
def test_hf_recipes_train_end_to_end_and_export(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the recipes' token file path is relative to the repository root
    result = runner.invoke(app, ["train", f"recipes/{name}.yaml", f"run.root={tmp_path}", "train.steps=30",
                                 "profile.runtime_probe=false", "profile.repeats=2", "profile.warmup=1"])
    assert result.exit_code == 0, result.output
    run = tmp_path / name
    lines = [json.loads(x) for x in (run / "train/metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if not x.get("final") and "eval_loss" not in x]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, steps  # seeded: the same numbers on any host
    start = [x for x in lines if "eval_loss" in x and not x.get("final")][0]  # train.eval_at_start
    end = [x for x in lines if x.get("final")][0]
    assert start["step"] == 0 and end["eval_perplexity"] < start["eval_perplexity"] - 10, (start, end)
    manifest = json.loads((run / "stages/manifest.json").read_text())
    assert manifest["num_stages"] == 2
    exported = runner.invoke(app, ["export", str(run), "-o", str(tmp_path / "model.pt")])
    assert exported.exit_code == 0, exported.output
    model = build_model(load_resolved(run / "config.yaml").model)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    if name == "gpt2_hf":
        assert [sorted(g) for g in tied_holders(manifest)] == [[0, 1]]
        assert model.lm_head.weight is model.transformer.wte.weight
    else:
        assert tied_holders(manifest) == []
