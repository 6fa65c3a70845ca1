"""A tiny hand-split model in the compiler's stage format, to test the runtime on its own.

`ToyNet(K)`: a = fc0(flatten(x)); h0 = relu(a); g0 = tanh(a); h1 = relu(fc1(h0)) + g0;
h_k = relu(fc_k(h_{k-1})) (+ h0 at k = 2, a skip connection); logits = head(h_{K-1}).
Split one `fc` per stage, it exercises a two-tensor message (h0, g0 from stage 0 to 1),
an output with two peers and a message that skips a stage (h0 from stage 0 to 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ToyNet(nn.Module):
    def __init__(self, num_stages: int, in_features: int = 16, width: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        if num_stages < 2:
            raise ValueError(f"ToyNet needs >= 2 stages, got {num_stages}")
        self.num_stages = num_stages
        self.fc = nn.ModuleList([nn.Linear(in_features if i == 0 else width, width) for i in range(num_stages)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        a = self.fc[0](x.flatten(1))
        h0, g0 = F.relu(a), torch.tanh(a)
        h = F.relu(self.fc[1](h0)) + g0
        for k in range(2, self.num_stages):
            h = F.relu(self.fc[k](h)) + (h0 if k == 2 else 0)
        return self.head(h)


def _stage_source(k: int, num_stages: int, in_features: int, width: int, num_classes: int) -> str:
    last = k == num_stages - 1
    lines = [
        f'"""Stage {k} of ToyNet({num_stages}) (hand-written, compiler format)."""',
        "import torch",
        "import torch.nn.functional as F",
        "from torch import nn",
        "",
        "",
        f"class Stage{k}(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        f"        self.fc = nn.Linear({in_features if k == 0 else width}, {width})",
    ]
    if last:
        lines.append(f"        self.head = nn.Linear({width}, {num_classes})")
    if k == 0:
        args, body = "x", ["a = self.fc(x.flatten(1))", "h0 = F.relu(a)", "g0 = torch.tanh(a)"]
        outs = ["h0", "g0"]
    elif k == 1:
        args, body = "h0, g0", ["h1 = F.relu(self.fc(h0)) + g0"]
        outs = ["h1"]
    elif k == 2:
        args, body = "h1, h0", ["h2 = F.relu(self.fc(h1)) + h0"]
        outs = ["h2"]
    else:
        args, body = f"h{k - 1}", [f"h{k} = F.relu(self.fc(h{k - 1}))"]
        outs = [f"h{k}"]
    if last:
        body.append(f"output = self.head({outs[0]})")
        outs = ["output"]
    lines.append(f"    def forward(self, {args}):")
    lines += [f"        {b}" for b in body]
    lines.append(f"        return ({', '.join(outs)},)")
    lines += ["", "", f"def build():", f"    return Stage{k}()", ""]
    return "\n".join(lines)


def _manifest(num_stages: int, mb: int, in_features: int, width: int, num_classes: int) -> dict[str, Any]:
    def t(name: str, shape: list[int], **peer: Any) -> dict[str, Any]:
        return {"name": name, "shape": shape, "dtype": "float32", **peer}

    side = int(round(in_features**0.5))
    stages = []
    for k in range(num_stages):
        last = k == num_stages - 1
        names = {"fc.weight": f"fc.{k}.weight", "fc.bias": f"fc.{k}.bias"}
        if last:
            names.update({"head.weight": "head.weight", "head.bias": "head.bias"})
        if k == 0:
            inputs = [t("x", [mb, 1, side, side], peer="data")]
            outputs = [t("h0", [mb, width], peers=[1, 2] if num_stages > 2 else [1]), t("g0", [mb, width], peers=[1])]
        elif k == 2:
            inputs = [t("h1", [mb, width], peer=1), t("h0", [mb, width], peer=0)]
            outputs = [t("h2", [mb, width], peers=[3])]
        else:
            inputs = [t("h0", [mb, width], peer=0), t("g0", [mb, width], peer=0)] if k == 1 else [t(f"h{k - 1}", [mb, width], peer=k - 1)]
            outputs = [t(f"h{k}", [mb, width], peers=[k + 1])]
        if last:
            outputs = [t("output", [mb, num_classes], peers=["loss"])]
        stages.append(
            {"stage_id": k, "module": f"stage_{k}.py", "weights": f"stage_{k}.pt", "class_name": f"Stage{k}",
             "param_names": names, "inputs": inputs, "outputs": outputs}
        )
    return {"version": 1, "num_stages": num_stages, "microbatch_size": mb, "model_inputs": ["x"],
            "loss": "cross_entropy", "stages": stages}


def write_toy_stages(stages_dir: Path, model: ToyNet, microbatch_size: int) -> dict[str, Any]:
    """Write stage_<k>.py/.pt and manifest.json for `model` (weights copied from it)."""
    stages_dir.mkdir(parents=True, exist_ok=True)
    k_total = model.num_stages
    in_features, width = model.fc[0].in_features, model.fc[0].out_features
    num_classes = model.head.out_features
    manifest = _manifest(k_total, microbatch_size, in_features, width, num_classes)
    state = model.state_dict()
    for entry in manifest["stages"]:
        k = entry["stage_id"]
        (stages_dir / entry["module"]).write_text(_stage_source(k, k_total, in_features, width, num_classes))
        weights = {orig: state[orig].clone() for orig in entry["param_names"].values()}
        torch.save(weights, stages_dir / entry["weights"])
    (stages_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def toy_plan(replicas: list[int]) -> dict[str, Any]:
    """A plan.json for the toy split: stage k has replicas[k] contiguous ranks."""
    stages, rank = [], 0
    for k, r in enumerate(replicas):
        stages.append({"stage_id": k, "start": k, "end": k + 1, "replicas": r, "ranks": list(range(rank, rank + r))})
        rank += r
    return {"version": 1, "inputs": {}, "stages": stages, "pipeline": {}}


def write_toy_run(run_dir: Path, cfg: Any, replicas: list[int], seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A complete toy run directory (config.yaml, stages/, plan) for `cfg`; returns (plan, manifest).

    `cfg.data` must yield 16 features per sample (e.g. synthetic_images 1x4x4, 4 classes).
    """
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    torch.manual_seed(seed)
    model = ToyNet(len(replicas))
    manifest = write_toy_stages(run_dir / "stages", model, cfg.data.batch_size // cfg.schedule.num_microbatches)
    plan = toy_plan(replicas)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))
    return plan, manifest
