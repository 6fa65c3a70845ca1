"""What a plan is asked for: schedule, microbatches, memory limit, search switches."""

from __future__ import annotations

from dataclasses import dataclass

from pdcli.config.schema import COST_MODELS, PRECISIONS
from pdcli.errors import UserError
from pdcli.planner.steer import SplitPoint
from pdcli.schedule.orders import Order
from pdcli.schedule.spec import PIPEDREAM, SCHEDULES, merges_weight_grads, switch_problems

COST_PD = "pd"
COST_PIPEDREAM = "pipedream"
POSITION_PAIR_BYTES = 256
"""The search's memory per pair of chain positions (measured: 2000 positions, about 1 GB)."""


def search_memory_text(positions: int) -> str:
    """About how much memory the search over `positions` chain positions takes, for messages."""
    return gb_text(positions ** 2 * POSITION_PAIR_BYTES)


def gb_text(nbytes: float) -> str:
    """`1.4 GB`, or `23 MB` below a GB."""
    return f"{nbytes / 2 ** 30:.1f} GB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.0f} MB"


def check_table(nbytes: float, what: str, options: "PlanOptions") -> None:
    """UserError (exit 2) when a table the search is about to allocate (`what`, about `nbytes`)
    exceeds the memory `plan.max_states` grants the search (its positions' pairs at
    POSITION_PAIR_BYTES); no check without a limit."""
    limit = options.max_positions
    if limit is None or nbytes <= limit ** 2 * POSITION_PAIR_BYTES:
        return
    raise UserError(f"{what} needs about {gb_text(nbytes)}, more than plan.max_states={limit} allows "
                    f"({search_memory_text(limit)})",
                    hint="use fewer devices per cluster level, plan.cost_model=pd, or raise plan.max_states if "
                         "this machine has the memory")


@dataclass(frozen=True)
class PlanOptions:
    schedule: str = PIPEDREAM
    """`pipedream`, `1f1b`, `gpipe`, `2bw` or `file` (hand-written: `orders`)."""
    num_microbatches: int = 1
    """Microbatches per minibatch."""
    batch_size: int = 1
    """Minibatch size in samples (the chain's costs are scaled to it when the chain
    records the batch size it was profiled with, `meta["batch_size"]`)."""
    memory_bytes_per_device: float | None = None
    """Memory budget of one device; None = unlimited."""
    straight: bool = False
    """One device per stage (no replication)."""
    use_fewer_devices: bool = False
    """Allow a plan on fewer devices than the cluster has when that is faster."""
    cost_model: str = COST_PD
    """`pd` (schedule-aware) or `pipedream` (PipeDream's optimizer, exact)."""
    num_stages: int | None = None
    """Force exactly this many stages; None = the search decides (or the fixed cuts and replicas)."""
    boundaries: tuple[int, ...] | None = None
    """Fixed cuts by chain position (where stages 1.. start); None = none."""
    split_points: tuple[SplitPoint, ...] = ()
    """Fixed cuts by module name (`pdcli.planner.steer`); the profile's `pipe_split()` markers are
    fixed cuts too."""
    pipe_splits: bool = True
    """Cut where the profile recorded `pipe_split()` calls (`meta.pipe_split_positions`)."""
    replicas: tuple[int, ...] | None = None
    """Fixed replicas per stage (one entry per stage); None = the search decides."""
    precision: str = "fp32"
    """`train.precision`: `bf16`/`fp16` halve the saved activations and add autocast's
    half-width weight copy per held microbatch (see planner.memory)."""
    recompute: bool = False
    """`train.recompute`: held microbatches keep only their stage inputs."""
    split_backward: bool = False
    """`schedule.split_backward` (gpipe, 1f1b): Linear weight gradients run in WeightGrads actions
    that fill the flush's bubble; the `pd` model replays the schedule for the bubble and holds
    1f1b's microbatches until their W (see planner.costs, planner.memory). The `pipedream`
    model ignores it."""
    merge_weight_grads: bool | None = None
    """`schedule.merge_weight_grads` (with `split_backward`): a chunk's WeightGrads wait for its
    minibatch's last Backward and run as one matmul per layer (`pdcli.schedule.lower` places
    them; the replay and the memory model take its lists), priced at the minibatch's rows where
    the profile measured them (`pdcli.profiler.batch_points`); None = the schedule's default
    (`merges_weight_grads`)."""
    vertical_sync: bool = False
    """`schedule.vertical_sync` (pipedream): a stage holds the weight versions stage 0's
    microbatches pin (see `ScheduleSpec.stash_depth`)."""
    max_positions: int | None = None
    """`plan.max_states`: the most chain positions the search takes (its memory grows with
    their square, `POSITION_PAIR_BYTES` per pair); None = no limit."""
    profile_sha256: str | None = None
    """Recorded in the plan's inputs when given."""
    virtual_stages: int = 1
    """`schedule.virtual_stages` (interleaved, loopedbfs, zbv): chunks per device; the plan's stages
    are then the chunks (`pdcli.planner.virtual`)."""
    refine: bool = True
    """With the runtime's costs, re-rank and refine the search's plan by replaying its action lists
    (other stage counts, each cut moved by up to two positions: `pdcli.planner.make.rank_by_replay`,
    `pdcli.planner.virtual.refine_by_replay`). The configuration search prices every configuration
    without it and plans the chosen one with it."""
    orders: tuple[Order, ...] = ()
    """`file`: each stage's written order (`pdcli.schedule.ScheduleSpec.orders`). The search prices
    the schedule as its stand-in (`1f1b`, `ScheduleRules.stand_in`); the replay of a plan with as
    many stages as orders runs these (`pdcli.planner.evaluate.replay`)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.cost_model not in COST_MODELS:
            raise UserError(f"cost model {self.cost_model!r} is not one of {', '.join(COST_MODELS)}")
        if self.precision not in PRECISIONS:
            raise UserError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.num_microbatches < 1:
            raise UserError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.memory_bytes_per_device is not None and not self.memory_bytes_per_device > 0:
            raise UserError(f"memory_bytes_per_device must be > 0, got {self.memory_bytes_per_device}")
        if self.num_stages is not None and self.num_stages < 1:
            raise UserError(f"num_stages must be >= 1, got {self.num_stages}")
        problems = switch_problems(self.schedule, self.vertical_sync, self.split_backward,
                                   bool(self.merge_weight_grads))
        if problems:
            raise UserError("; ".join(problems.values()), hint=f"set schedule.{' and '.join(problems)} to false")

    @property
    def merges_weight_grads(self) -> bool:
        """Whether the plan's run merges its weight gradients (`merge_weight_grads`, else the
        schedule's default with this `split_backward`)."""
        return merges_weight_grads(self.schedule, self.split_backward, self.merge_weight_grads)
