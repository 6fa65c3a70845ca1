"""The typed config schema: one dataclass per component, a one-line doc per field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

SCHEDULES = ("pipedream", "1f1b", "gpipe", "2bw")
FLUSH_SCHEDULES = ("1f1b", "gpipe")
PRECISIONS = ("fp32", "bf16", "fp16")
COST_MODELS = ("pd", "pipedream")
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("auto", "cpu", "cuda")
TRANSPORTS = ("socket", "gloo")
"""Activation/gradient transports (`train.transport`, which adds `auto`, and `PD_TRANSPORT`)."""


@dataclass
class ModelConfig:
    name: str = "mlp"
    """Built-in model (`pd config models` lists them); ignored when `target` is set."""
    target: Optional[str] = None
    """A user model factory as `package.module:factory`, called with `kwargs`."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model factory (sizes, depth, classes ...)."""
    loss: str = "cross_entropy"
    """Loss on the last stage: `cross_entropy` (classes on the last dim) or `mse`."""


@dataclass
class DataConfig:
    name: str = "synthetic_images"
    """Data set: `synthetic_images`, `synthetic_tokens`, `synthetic_seq2seq`, `digits`, `tensor_file`, `token_file`."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the data set (shapes, vocabulary, file paths ...)."""
    batch_size: int = 32
    """Minibatch size in samples (split into microbatches by the schedule)."""
    seed: int = 0
    """Seed of the data order and of synthetic data."""


@dataclass
class ClusterLevel:
    devices: int = 1
    """Devices joined at this level (innermost first: devices per node, then nodes)."""
    bandwidth_bytes_per_s: float = 10e9
    """Bandwidth between two devices that first meet at this level."""


@dataclass
class ClusterConfig:
    levels: List[ClusterLevel] = field(default_factory=lambda: [ClusterLevel(devices=2)])
    """Hierarchy of the cluster, innermost first; total devices = product of `devices`."""
    memory_bytes_per_device: Optional[float] = None
    """Memory budget of one device; null = unlimited."""
    device: str = "auto"
    """Where stages run: `auto` (CUDA if present, else CPU), `cpu`, `cuda`."""


@dataclass
class ProfileConfig:
    warmup: int = 2
    """Untimed iterations before measuring."""
    repeats: int = 5
    """Timed iterations; the median is recorded."""
    device: str = "auto"
    """Device to profile on: `auto`, `cpu`, `cuda`."""
    batch_size: Optional[int] = None
    """Batch size to profile with; null = the microbatch size of the schedule."""
    runtime_probe: bool = True
    """Also measure what the runtime pays per action (real stages run by its executor, the
    transport's latency and bandwidth), so `pd plan` predicts the run (`meta.runtime`)."""
    probe_minibatches: int = 12
    """Minibatches each probe stage runs (the second half is measured)."""
    pipeline_probe_minibatches: int = 40
    """After the probe, a real run of the schedule on two workers for this many minibatches
    refits its costs to what workers that share the host pay (0: off)."""


@dataclass
class PlanConfig:
    cost_model: str = "pd"
    """`pd` (schedule-aware, fwd/bwd split) or `pipedream` (PipeDream's optimizer, exact)."""
    straight: bool = False
    """Forbid replication: one device per stage."""
    use_fewer_devices: bool = True
    """Allow a plan on fewer devices than available when that is faster."""
    num_stages: Optional[int] = None
    """Force this many stages (cost_model=pd); null = let the search decide."""
    boundaries: Optional[List[int]] = None
    """Fix the split: chain positions where stages 1.. start (e.g. [9]); null = search."""
    replicas: Optional[List[int]] = None
    """With `boundaries`: the replicas of each stage (e.g. [2, 1]); null = one each."""


@dataclass
class ScheduleConfig:
    name: str = "pipedream"
    """`pipedream` (1F1B + weight stashing), `1f1b` (flush), `gpipe`, `2bw`."""
    num_microbatches: int = 4
    """Microbatches per minibatch (flush schedules, 2BW accumulation, pipedream in-flight)."""
    vertical_sync: bool = False
    """pipedream only: every stage uses the weight version stage 0 used for a minibatch."""
    split_backward: Optional[bool] = None
    """gpipe/1f1b: Linear weight gradients run later, filling the flush's bubble; null = on for them."""

    @property
    def split_backward_on(self) -> bool:
        """Whether the run splits backward: `split_backward`, or by default for gpipe and 1f1b."""
        flush = self.name in FLUSH_SCHEDULES
        return flush if self.split_backward is None else bool(self.split_backward) and flush


@dataclass
class OptimConfig:
    name: str = "sgd"
    """`sgd`, `adam` or `adamw`."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 weight decay."""


@dataclass
class TrainConfig:
    steps: int = 50
    """Minibatches of data to train on (pipedream updates once per microbatch: steps x M updates)."""
    precision: str = "fp32"
    """`fp32`, `bf16` (autocast) or `fp16` (autocast + loss scaling)."""
    recompute: bool = False
    """Recompute activations in backward instead of stashing them."""
    log_every: int = 5
    """Write a metrics line every this many steps."""
    checkpoint_every: int = 0
    """Checkpoint every this many minibatches (0 = only at the end); pipedream/2bw drain the pipeline there."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    seed: int = 0
    """Seed of the model's random init."""
    timeout_s: float = 30.0
    """A worker silent for this long stops the job."""
    threads_per_worker: Optional[int] = None
    """torch threads per CPU worker; null = cores / workers."""
    init_from: Optional[str] = None
    """Start from an exported state dict (`pd export RUN -o FILE`), loaded by parameter name into any plan's stages."""
    spin_wait_ms: Optional[float] = None
    """How long a worker polls for a message before it blocks (ms); null = 20 when this
    host's workers have a CPU core each (polling keeps an idle vCPU from falling asleep),
    else 0 (blocking at once leaves the core to the workers that share it)."""
    transport: str = "auto"
    """Activation/gradient transport: `auto` (sockets between CPU ranks, per pair: Unix inside
    a host, TCP between hosts; torch.distributed on GPUs), `socket`, or `gloo` (torch.distributed
    with the run's backend)."""


@dataclass
class RunConfig:
    name: str = "default"
    """Run name: artifacts go to `<root>/<name>/`."""
    root: str = "runs"
    """Directory that holds run directories."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def num_devices(self) -> int:
        n = 1
        for level in self.cluster.levels:
            n *= level.devices
        return n

    @property
    def microbatch_size(self) -> int:
        return self.data.batch_size // self.schedule.num_microbatches


GROUPS = ("model", "data", "cluster", "profile", "plan", "schedule", "optim", "train", "run")


def check_values(cfg: Config) -> list[str]:
    """Semantic checks beyond types: each problem names its key and the fix."""
    problems: list[str] = []

    def choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not one of {', '.join(allowed)}")

    def positive(key: str, value: float | int | None, allow_zero: bool = False) -> None:
        """A finite number > 0 (>= 0 with `allow_zero`): NaN and infinity count nothing."""
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            problems.append(f"{key}: must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")

    choice("schedule.name", cfg.schedule.name, SCHEDULES)
    choice("train.precision", cfg.train.precision, PRECISIONS)
    choice("plan.cost_model", cfg.plan.cost_model, COST_MODELS)
    choice("optim.name", cfg.optim.name, OPTIMIZERS)
    choice("cluster.device", cfg.cluster.device, DEVICES)
    choice("train.transport", cfg.train.transport, ("auto", *TRANSPORTS))
    choice("profile.device", cfg.profile.device, DEVICES)
    choice("model.loss", cfg.model.loss, ("cross_entropy", "mse"))
    positive("data.batch_size", cfg.data.batch_size)
    positive("schedule.num_microbatches", cfg.schedule.num_microbatches)
    positive("optim.lr", cfg.optim.lr)
    positive("optim.momentum", cfg.optim.momentum, allow_zero=True)
    positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    positive("train.steps", cfg.train.steps)
    positive("train.log_every", cfg.train.log_every)
    positive("train.checkpoint_every", cfg.train.checkpoint_every, allow_zero=True)
    positive("train.keep_checkpoints", cfg.train.keep_checkpoints)
    positive("train.timeout_s", cfg.train.timeout_s)
    positive("train.threads_per_worker", cfg.train.threads_per_worker)
    positive("train.spin_wait_ms", cfg.train.spin_wait_ms, allow_zero=True)
    if cfg.train.init_from is not None and not str(cfg.train.init_from).strip():
        problems.append("train.init_from: empty path; give a file written by `pd export` or null")
    positive("profile.repeats", cfg.profile.repeats)
    positive("profile.warmup", cfg.profile.warmup, allow_zero=True)
    positive("profile.batch_size", cfg.profile.batch_size)
    positive("profile.probe_minibatches", cfg.profile.probe_minibatches)
    positive("profile.pipeline_probe_minibatches", cfg.profile.pipeline_probe_minibatches, allow_zero=True)
    positive("plan.num_stages", cfg.plan.num_stages)
    positive("cluster.memory_bytes_per_device", cfg.cluster.memory_bytes_per_device)
    if not cfg.cluster.levels:
        problems.append("cluster.levels: needs at least one level, e.g. [{devices: 2}]")
    for i, level in enumerate(cfg.cluster.levels):
        positive(f"cluster.levels.{i}.devices", level.devices)
        positive(f"cluster.levels.{i}.bandwidth_bytes_per_s", level.bandwidth_bytes_per_s)
    if (
        cfg.data.batch_size > 0
        and cfg.schedule.num_microbatches > 0
        and cfg.data.batch_size % cfg.schedule.num_microbatches
    ):
        problems.append(
            f"data.batch_size: {cfg.data.batch_size} is not divisible by "
            f"schedule.num_microbatches={cfg.schedule.num_microbatches}; pick a multiple"
        )
    if cfg.schedule.vertical_sync and cfg.schedule.name != "pipedream":
        problems.append("schedule.vertical_sync: only applies to schedule.name=pipedream")
    if cfg.schedule.split_backward and cfg.schedule.name not in FLUSH_SCHEDULES:
        problems.append(
            f"schedule.split_backward: only applies to schedule.name=1f1b or gpipe (it fills their flush "
            f"bubble; {cfg.schedule.name} has none); set it to null or false"
        )
    if cfg.model.target is not None and ":" not in cfg.model.target:
        problems.append(
            f"model.target: {cfg.model.target!r} must look like `package.module:factory`"
        )
    return problems
