"""The typed config schema: one dataclass per component, a one-line doc per field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pdcli.schedule.spec import (
    FLUSH_SCHEDULES, FILE, PIPEDREAM, SCHEDULES, merges_weight_grads, rules, switch_problems, virtual_problems,
)

PRECISIONS = ("fp32", "bf16", "fp16")
COST_MODELS = ("pd", "pipedream")
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("auto", "cpu", "cuda")
TRANSPORTS = ("socket", "gloo")
LR_SCHEDULES = ("constant", "linear", "cosine", "step")
LR_UNITS = ("minibatches", "samples")
"""Activation/gradient transports (`train.transport`, which adds `auto`, and `PD_TRANSPORT`)."""
SPLIT_AT_BEGIN = "begin"
SPLIT_AT_END = "end"


def split_point_fields(item: Any) -> tuple[str, str]:
    """A `plan.split_points` entry as (module name, `begin`|`end`): `layer2` (cut before it),
    `layer3:end` or {name: layer3, at: end} (cut after it); a number is the name of an
    `nn.Sequential` child (`5`). ValueError saying what is wrong."""
    if isinstance(item, int) and not isinstance(item, bool):
        item = str(item)
    if isinstance(item, str):
        name, _, at = item.partition(":")
        at = at or SPLIT_AT_BEGIN
    elif isinstance(item, dict) and set(item) <= {"name", "at"} and isinstance(item.get("name"), str):
        name, at = item["name"], item.get("at") or SPLIT_AT_BEGIN
    else:
        raise ValueError(f"{item!r} is not a module name (`layer2`, `layer3:end`) or {{name: layer3, at: end}}")
    if not name.strip() or name != name.strip():
        raise ValueError(f"{item!r}: the module name is empty or padded with spaces")
    if at not in (SPLIT_AT_BEGIN, SPLIT_AT_END):
        raise ValueError(f"{item!r}: `at` must be {SPLIT_AT_BEGIN} or {SPLIT_AT_END}, got {at!r}")
    return name, at


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
    # ---- Hugging Face models ----
    hf: Optional[str] = None
    """A Hugging Face `transformers` model type (`gpt2`, `llama`, ...): its causal-LM model built
    from the type's default config with `kwargs` overriding config fields, random weights, nothing
    downloaded; wins over `name`, exclusive with `target`."""


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
    eval_path: Optional[str] = None
    """`tensor_file`/`token_file`: a file of the same kind holding the held-out split; null = hold
    out `eval_fraction` of the training file."""
    eval_fraction: float = 0.1
    """Fraction of a file set held out for evaluation when `eval_path` is null (fixed rows)."""


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
    """Minibatches each probe stage runs at least (the second half is measured)."""
    probe_seconds: float = 0.25
    """Each probe stage runs at least this long in its measured half, by a pilot run of
    `probe_minibatches` (more minibatches for a fast stage): a few milliseconds of samples would
    fit the host's noise."""
    pipeline_probe_minibatches: int = 40
    """After the probe, a real run of the schedule on two workers for at least this many
    minibatches refits its costs to what workers that share the host pay (0: off)."""
    pipeline_probe_seconds: float = 2.0
    """The pipeline probe's measured half lasts at least about this long (by the in-process
    probe's time of a minibatch): its latency and scale are fitted to what that half measured."""
    pipeline_probe_runs: int = 3
    """The pipeline probe trains at most this many times and keeps the run with the median steady
    time (one run's speed is one draw of the host's run-to-run spread)."""
    pipeline_probe_agree: float = 0.03
    """The pipeline probe stops once two of its runs' steady times are this close (relative; 0:
    every run of `pipeline_probe_runs` trains)."""
    defer_pipeline_probe: bool = True
    """`pd train` does not wait for the pipeline probe where the recipe fixes the pipeline's
    shape (`pdcli.steps.profile.shape_fixed`): the planner then only places the cuts, which
    the stages measured alone price, and the run is its own measurement. `pd profile` and
    `pd plan` add the probe to the same profile (false: `pd train` runs it first too)."""
    host_cache: str = ""
    """Where the host calibration file is kept (`pdcli.probe.hostfile`): empty = $PD_CACHE_DIR,
    else ~/.cache/pd; `off` = measure the host in every profile and keep nothing."""
    host_cache_max_days: float = 30.0
    """A host file older than this many days is measured again (0: never by its age)."""


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
    split_points: Optional[List[Any]] = None
    """Fix cuts by module name (`model.named_modules()`): `layer2` cuts before the module,
    `layer3:end` or {name: layer3, at: end} after it; the search places any other cut."""
    pipe_splits: bool = True
    """Cut where the model's forward calls `pdcli.pipe_split()`; false ignores the calls."""
    boundaries: Optional[List[int]] = None
    """Fix cuts by chain position (where stages 1.. start, e.g. [9]); null = search."""
    replicas: Optional[List[int]] = None
    """Fix the replicas of each stage (e.g. [3, 1]: one entry per stage); null = search."""
    search: List[str] = field(default_factory=list)
    """Fields the planner chooses jointly with the partition (`schedule.name`,
    `schedule.num_microbatches`, `train.recompute`, `train.precision`): a recipe asks for it by
    setting them to `auto`."""
    objective: str = "throughput"
    """Which point of the searched configurations' Pareto front `pd plan` picks: `throughput`
    (least time per minibatch) or `memory` (least peak memory of a device)."""
    max_staleness: Optional[int] = None
    """The most optimizer steps a minibatch's weights may lag (0: flush schedules only, exact
    sequential semantics; 1 admits 2bw); null = any."""
    max_states: int = 2000
    """The most chain positions the search takes (a PipeDream graph.txt: antichain states, the
    linearization stops there); past it `pd plan` stops with exit 2 (the search's memory grows
    with their square: 2000 take about 1 GB)."""


@dataclass
class ScheduleConfig:
    name: str = PIPEDREAM
    """`pipedream` (1F1B + weight stashing), `1f1b` (flush), `gpipe`, `2bw`, `file` (hand-written: `path`)."""
    num_microbatches: int = 4
    """Microbatches per minibatch (flush schedules, 2BW accumulation, pipedream in-flight)."""
    vertical_sync: bool = False
    """pipedream only: every stage uses the weight version stage 0 used for a minibatch."""
    split_backward: Optional[bool] = None
    """gpipe/1f1b/file: Linear weight gradients run later, filling the flush's bubble; null = on for them."""
    path: Optional[str] = None
    """file: the schedule file, one line of actions per device (relative to the current directory,
    else to the recipe's); read when the config loads, into `orders`."""
    orders: Optional[List[str]] = None
    """file: the device lines of `path` (filled in when the config loads and null; the run directory's
    config.yaml carries them to every worker); or the lines themselves, without a file."""
    virtual_stages: int = 1
    """interleaved/loopedbfs (>= 1), zbv (2): model chunks per device; the plan cuts the model into
    devices x virtual_stages chunks, placed in loops (interleaved, loopedbfs) or a V (zbv)."""
    merge_weight_grads: Optional[bool] = None
    """Split backward on gpipe, 1f1b, interleaved, loopedbfs or a file without W's: a chunk's
    weight gradients wait for its minibatch's last Backward and run as one matmul per Linear
    layer over the minibatch's rows, at the flush or where the device waits and no peer waits
    for it (faster where microbatches are small; holds every microbatch's Linear inputs and
    output gradients until then); null = on for loopedbfs (split), off for the others."""

    @property
    def split_backward_on(self) -> bool:
        """Whether the run splits backward: `split_backward`, or by default for gpipe and 1f1b."""
        flush = self.name in FLUSH_SCHEDULES
        return flush if self.split_backward is None else bool(self.split_backward) and flush

    @property
    def merge_weight_grads_on(self) -> bool:
        """Whether the run merges its weight gradients: `merge_weight_grads`, or by default for
        loopedbfs with a split backward (`pdcli.schedule.spec.merges_weight_grads`)."""
        return merges_weight_grads(self.name, self.split_backward_on, self.merge_weight_grads)


@dataclass
class LRScheduleConfig:
    name: str = "constant"
    """After the warm-up: `constant`, `linear` or `cosine` decay to `final_fraction`, `step` decay."""
    unit: str = "minibatches"
    """Unit of `warmup`, `decay` and `step_every`: `minibatches` (of data.batch_size samples) or `samples`."""
    warmup: float = 0.0
    """Linear warm-up from 0 to optim.lr over this many units."""
    decay: Optional[float] = None
    """linear/cosine: units from the end of the warm-up to `final_fraction`; null = to the end of training."""
    final_fraction: float = 0.0
    """linear/cosine: the learning rate at the end of the decay, as a fraction of optim.lr."""
    step_every: float = 1.0
    """step: multiply the learning rate by `gamma` every this many units after the warm-up."""
    gamma: float = 0.1
    """step: the factor of each decay step."""


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
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning-rate schedule over the samples of data trained on (the same curve for every schedule)."""
    clip_grad_norm: Optional[float] = None
    """Clip gradients to this global L2 norm before each update (pipedream: each stage's own norm); null = off."""


@dataclass
class TrainConfig:
    steps: int = 50
    """Minibatches of data to train on (pipedream updates once per microbatch: steps x M updates)."""
    epochs: Optional[float] = None
    """Passes over a finite training set; when set it replaces `steps` (ceil(epochs x examples / batch_size))."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many minibatches (0: only at the end)."""
    eval_at_start: bool = False
    """Also evaluate before the first training step."""
    eval_batches: Optional[int] = None
    """Minibatches of the held-out split per evaluation; null = all of a finite split (8 of a
    synthetic one); 0 = no evaluation."""
    tensorboard: bool = True
    """Also write scalars to `train/tensorboard/` when the `tensorboard` package is installed."""
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
    divergence: Optional[float] = 3.0
    """Stop the run when its smoothed loss (moving average over ~10 minibatches) climbs above
    this many times its start (the mean of the first 10 minibatches); null = no guard. A
    non-finite loss or gradient always stops it."""
    max_restarts: int = 0
    """After a worker dies or goes silent, restart every worker from the newest complete
    checkpoint up to this many times (torch's elastic agent); 0 = stop at the first failure."""
    threads_per_worker: Optional[int] = None
    """torch threads per CPU worker; null = cores / workers."""
    bind_cores: bool = True
    """Pin each CPU worker to its own equal share of the host's cores (as DeepSpeed's
    `--bind_cores_to_rank`) where this host's workers are no more than its cores, so the OS
    does not put two workers on one core; false for jobs that share a host's cores."""
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
    measure_link: bool = True
    """On several hosts, measure the link between node 0 and node 1 once at the start (about a
    second at most) into `train/link.json`, and warn when it is more than 2x off the plan's
    `cluster.levels` bandwidth; false skips it."""


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


SEARCHABLE = ("schedule.name", "schedule.num_microbatches", "train.recompute", "train.precision")
"""Config fields `auto` hands to the planner (`plan.search`)."""
PLAN_OBJECTIVES = ("throughput", "memory")


GROUPS = ("model", "data", "cluster", "profile", "plan", "schedule", "optim", "train", "run")


class _Problems(list[str]):
    """What `check_values` found, each naming its key and the fix."""

    def choice(self, key: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            self.append(f"{key}: {value!r} is not one of {', '.join(allowed)}")

    def positive(self, key: str, value: float | int | None, allow_zero: bool = False) -> None:
        """A finite number > 0 (>= 0 with `allow_zero`): NaN and infinity count nothing."""
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            self.append(f"{key}: must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_values(cfg: Config) -> list[str]:
    """Semantic checks beyond types: each problem names its key and the fix."""
    p = _Problems()
    for section in (_kind_problems, _data_and_optim_problems, _train_problems, _profile_problems,
                    _plan_and_cluster_problems, _schedule_and_model_problems):
        section(cfg, p)
    return list(p)


def _kind_problems(cfg: Config, p: _Problems) -> None:
    """The names chosen among a few: schedule, precision, cost model, optimizer, devices, transport, loss."""
    p.choice("schedule.name", cfg.schedule.name, SCHEDULES)
    p.choice("train.precision", cfg.train.precision, PRECISIONS)
    p.choice("plan.cost_model", cfg.plan.cost_model, COST_MODELS)
    p.choice("optim.name", cfg.optim.name, OPTIMIZERS)
    p.choice("cluster.device", cfg.cluster.device, DEVICES)
    p.choice("train.transport", cfg.train.transport, ("auto", *TRANSPORTS))
    p.choice("profile.device", cfg.profile.device, DEVICES)
    p.choice("model.loss", cfg.model.loss, ("cross_entropy", "mse"))


def _data_and_optim_problems(cfg: Config, p: _Problems) -> None:
    """The minibatch, the optimizer and its learning-rate schedule, the steps, the held-out split."""
    p.positive("data.batch_size", cfg.data.batch_size)
    p.positive("schedule.num_microbatches", cfg.schedule.num_microbatches)
    p.positive("optim.lr", cfg.optim.lr)
    p.positive("optim.momentum", cfg.optim.momentum, allow_zero=True)
    p.positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    p.positive("train.steps", cfg.train.steps)
    p.positive("train.epochs", cfg.train.epochs)
    p.positive("train.eval_every", cfg.train.eval_every, allow_zero=True)
    p.positive("train.eval_batches", cfg.train.eval_batches, allow_zero=True)
    p.positive("optim.clip_grad_norm", cfg.optim.clip_grad_norm)
    lr = cfg.optim.schedule
    p.choice("optim.schedule.name", lr.name, LR_SCHEDULES)
    p.choice("optim.schedule.unit", lr.unit, LR_UNITS)
    p.positive("optim.schedule.warmup", lr.warmup, allow_zero=True)
    p.positive("optim.schedule.decay", lr.decay)
    p.positive("optim.schedule.final_fraction", lr.final_fraction, allow_zero=True)
    p.positive("optim.schedule.step_every", lr.step_every)
    p.positive("optim.schedule.gamma", lr.gamma)
    if not 0 < cfg.data.eval_fraction < 1:
        p.append(f"data.eval_fraction: must be between 0 and 1 (exclusive), got {cfg.data.eval_fraction}")
    if cfg.data.eval_path is not None and not str(cfg.data.eval_path).strip():
        p.append("data.eval_path: empty path; give the held-out file or null")


def _train_problems(cfg: Config, p: _Problems) -> None:
    """The training loop's own settings."""
    p.positive("train.log_every", cfg.train.log_every)
    p.positive("train.checkpoint_every", cfg.train.checkpoint_every, allow_zero=True)
    p.positive("train.keep_checkpoints", cfg.train.keep_checkpoints)
    p.positive("train.timeout_s", cfg.train.timeout_s)
    p.positive("train.max_restarts", cfg.train.max_restarts, allow_zero=True)
    p.positive("train.divergence", cfg.train.divergence)
    if cfg.train.divergence is not None and math.isfinite(cfg.train.divergence) and 0 < cfg.train.divergence <= 1:
        p.append(f"train.divergence: {cfg.train.divergence} would stop a run whose loss does not fall; "
                 "give a factor > 1 (e.g. 3) or null to turn the guard off")
    p.positive("train.threads_per_worker", cfg.train.threads_per_worker)
    p.positive("train.spin_wait_ms", cfg.train.spin_wait_ms, allow_zero=True)
    if cfg.train.init_from is not None and not str(cfg.train.init_from).strip():
        p.append("train.init_from: empty path; give a file written by `pd export` or null")


def _profile_problems(cfg: Config, p: _Problems) -> None:
    """The profiler's and the probes' settings."""
    p.positive("profile.repeats", cfg.profile.repeats)
    p.positive("profile.warmup", cfg.profile.warmup, allow_zero=True)
    p.positive("profile.batch_size", cfg.profile.batch_size)
    p.positive("profile.probe_minibatches", cfg.profile.probe_minibatches)
    p.positive("profile.pipeline_probe_minibatches", cfg.profile.pipeline_probe_minibatches, allow_zero=True)
    p.positive("profile.probe_seconds", cfg.profile.probe_seconds, allow_zero=True)
    p.positive("profile.pipeline_probe_seconds", cfg.profile.pipeline_probe_seconds, allow_zero=True)
    p.positive("profile.pipeline_probe_runs", cfg.profile.pipeline_probe_runs)
    p.positive("profile.pipeline_probe_agree", cfg.profile.pipeline_probe_agree, allow_zero=True)
    p.positive("profile.host_cache_max_days", cfg.profile.host_cache_max_days, allow_zero=True)


def _plan_and_cluster_problems(cfg: Config, p: _Problems) -> None:
    """The planner's settings and the cluster."""
    p.positive("plan.num_stages", cfg.plan.num_stages)
    p.positive("plan.max_states", cfg.plan.max_states)
    p.positive("plan.max_staleness", cfg.plan.max_staleness, allow_zero=True)
    p.choice("plan.objective", cfg.plan.objective, PLAN_OBJECTIVES)
    for i, key in enumerate(cfg.plan.search):
        p.choice(f"plan.search.{i}", key, SEARCHABLE)
    if cfg.plan.search and cfg.plan.cost_model != "pd":
        p.append("plan.search: the configuration search needs plan.cost_model=pd (PipeDream's optimizer "
                 "prices its own schedule only); set the schedule fields instead of `auto`")
    for i, item in enumerate(cfg.plan.split_points or []):
        try:
            split_point_fields(item)
        except ValueError as e:
            p.append(f"plan.split_points.{i}: {e}")
    p.positive("cluster.memory_bytes_per_device", cfg.cluster.memory_bytes_per_device)
    if not cfg.cluster.levels:
        p.append("cluster.levels: needs at least one level, e.g. [{devices: 2}]")
    for i, level in enumerate(cfg.cluster.levels):
        p.positive(f"cluster.levels.{i}.devices", level.devices)
        p.positive(f"cluster.levels.{i}.bandwidth_bytes_per_s", level.bandwidth_bytes_per_s)


def _schedule_and_model_problems(cfg: Config, p: _Problems) -> None:
    """The minibatch against the microbatches, the schedule's switches, the model's source."""
    if (
        cfg.data.batch_size > 0
        and cfg.schedule.num_microbatches > 0
        and cfg.data.batch_size % cfg.schedule.num_microbatches
    ):
        p.append(
            f"data.batch_size: {cfg.data.batch_size} is not divisible by "
            f"schedule.num_microbatches={cfg.schedule.num_microbatches}; pick a multiple"
        )
    p.extend(_written_schedule_problems(cfg))
    p.extend(_virtual_stage_problems(cfg))
    fixes = {"vertical_sync": "set it to false", "split_backward": "set it to null or false",
             "merge_weight_grads": "set it to false"}
    for switch, why in switch_problems(cfg.schedule.name, cfg.schedule.vertical_sync,
                                       bool(cfg.schedule.split_backward) or cfg.schedule.split_backward_on,
                                       bool(cfg.schedule.merge_weight_grads)).items():
        p.append(f"schedule.{switch}: {why}; {fixes[switch]}")
    if cfg.model.hf is not None and cfg.model.target is not None:
        p.append("model.hf: set either model.hf or model.target, not both (model.target=null or '~model.hf')")
    if cfg.model.target is not None and ":" not in cfg.model.target:
        p.append(
            f"model.target: {cfg.model.target!r} must look like `package.module:factory`"
        )


def _virtual_stage_problems(cfg: Config) -> list[str]:
    """Virtual stages (`schedule.virtual_stages`) go with the chunked schedules only, one device per
    pipeline position."""
    schedule = cfg.schedule
    if schedule.name not in SCHEDULES or schedule.virtual_stages < 1:
        return [] if schedule.virtual_stages >= 1 else [
            f"schedule.virtual_stages: must be >= 1, got {schedule.virtual_stages}"]
    num_devices = cfg.plan.num_stages
    problems = [f"{key}: {why}" for key, why in virtual_problems(
        schedule.name, schedule.virtual_stages, schedule.split_backward_on, schedule.num_microbatches,
        num_devices).items()]
    if rules(schedule.name).chunked:
        if cfg.plan.replicas is not None and any(r != 1 for r in cfg.plan.replicas):
            problems.append(f"plan.replicas: {list(cfg.plan.replicas)}, but schedule.name={schedule.name} runs one "
                            f"device per pipeline position; leave plan.replicas unset")
    return problems


def _written_schedule_problems(cfg: Config) -> list[str]:
    """A hand-written schedule (`schedule.name: file`) has its lines, one device per stage and a
    line per stage (the lines themselves, and what they leave a merge to do, are checked as the loader
    reads them)."""
    schedule, plan = cfg.schedule, cfg.plan
    if schedule.name not in SCHEDULES or not rules(schedule.name).hand_written:
        return []
    if schedule.orders is None:
        return [] if schedule.path is not None else [
            f"schedule.name: {FILE} needs the schedule file (one line of actions per device); "
            "set schedule.path=my_schedule.txt"]
    problems = []
    if "schedule.num_microbatches" in plan.search:
        problems.append(f"schedule.num_microbatches: `auto` does not go with schedule.name={FILE}: the lines of "
                        f"{schedule.path or 'schedule.orders'} fix the microbatches; give their count")
    if not rules(schedule.name).replicable and plan.replicas is not None and any(r != 1 for r in plan.replicas):
        problems.append(f"plan.replicas: {list(plan.replicas)}, but schedule.name={FILE} runs one device per stage "
                        f"(a line of {schedule.path or 'schedule.orders'} each); leave plan.replicas unset")
    if plan.num_stages is not None and plan.num_stages != len(schedule.orders):
        problems.append(f"plan.num_stages: {plan.num_stages} stages, but {schedule.path or 'schedule.orders'} has "
                        f"{len(schedule.orders)} device lines (one per stage); set plan.num_stages="
                        f"{len(schedule.orders)} or write a line per stage")
    return problems
