"""Pipeline schedules as data, pure (no torch, no processes).

- `spec`: `ScheduleSpec`, the parameters of a run and the rules of each schedule (weight
  version, stash depth, drain points, what is valid);
- `actions`: the typed actions a process runs and their compact text form;
- `lower`: a schedule's compute order lowered into every process's full action list;
- `periodic`: a long run's list computed action by action from a few short runs' (`ActionList`);
- `orders`, `handwritten`: a hand-written schedule (`file`): its lines read, and checked before it runs;
- `virtual`: virtual stages: chunks placed on devices (loop, V) and the chunked schedules' orders
  (`interleaved`, `loopedbfs`, `zbv`);
- `checker`: proof that a set of lists runs (matching messages, no deadlock, the declared
  versions and stash depths);
- `simulator`: the same lists replayed with costs, a predicted timeline.

The planner and the runtime both build on this package; neither imports the other.
"""

from pdcli.schedule.actions import (
    ACTION_TYPES, Action, AllReduceGrads, Backward, EndEval, EvalForward, Forward, FreeWeights, LoadMicrobatch,
    OptimizerStep, RecvActivations, RecvGrads, SendActivations, SendGrads, StashWeights, UnknownActionError,
    WeightGrads, action_text, dispatch, parse_action,
)
from pdcli.schedule.periodic import ActionList, action_kinds, kept_actions
from pdcli.schedule.lower import build_all, build_for, build_schedule, one_f_one_b, sends_first, stash_depth
from pdcli.schedule.spec import (
    FILE, FLUSH_SCHEDULES, GPIPE, ONE_F_ONE_B, PIPEDREAM, SCHEDULES, TWO_BW, ScheduleSpec, StashDepth, drain_points,
    eval_points, replica_for,
)

__all__ = [
    "Action", "ACTION_TYPES", "ActionList", "action_kinds", "kept_actions", "AllReduceGrads", "Backward", "EndEval", "EvalForward", "FILE", "FLUSH_SCHEDULES", "Forward",
    "FreeWeights", "GPIPE", "LoadMicrobatch", "ONE_F_ONE_B", "OptimizerStep", "PIPEDREAM", "RecvActivations",
    "RecvGrads", "SCHEDULES", "ScheduleSpec", "SendActivations", "SendGrads", "StashDepth", "StashWeights", "TWO_BW",
    "UnknownActionError", "WeightGrads", "action_text", "build_all", "build_for", "build_schedule", "dispatch", "drain_points",
    "eval_points", "one_f_one_b", "parse_action", "replica_for", "sends_first", "stash_depth",
]
