"""`pd plan` output: the stage table (bottleneck marked `*`) and the pipeline summary line."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from pdcli.planner.pareto import stage_delays
from pdcli.planner.plan import Plan
from pdcli.errors import UserError
from pdcli.profiler.chain import Chain
from pdcli.profiler.summary import format_bytes
from pdcli.rundir import canonical_json
from pdcli.schedule import SCHEDULES

FORMATS = ("text", "markdown", "json")
TABLE_STYLE = {"text": "simple", "markdown": "github"}
LABEL_CHARS = 28
BOTTLENECK_MARK = "*"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 3] + "..."


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> `0-2,5`."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _label(chain: Chain | None, position: int, name: str) -> str:
    if chain is not None and 0 <= position < len(chain.nodes) and chain.nodes[position].name == name:
        return _short(chain.nodes[position].label or name)
    return _short(name)


def summary_line(pipeline: dict[str, Any]) -> str:
    return (
        f"time per minibatch {pipeline['time_per_minibatch_ms']:.4g} ms, "
        f"{pipeline['throughput_samples_per_s']:.4g} samples/s, "
        f"{pipeline['speedup_over_data_parallel']:.3g}x data parallel "
        f"({pipeline['data_parallel_time_per_minibatch_ms']:.4g} ms), "
        f"{pipeline['num_devices_used']} of {pipeline['num_devices']} devices, "
        f"bottleneck stage {pipeline['bottleneck_stage']}"
    )


def shape_line(plan_json: dict[str, Any]) -> str | None:
    """What kind of parallelism the plan is, when it is not a plain pipeline: data parallelism
    (one stage on several devices, what torch DDP runs) or a hybrid (some stage replicated)."""
    stages = plan_json["stages"]
    devices = sum(int(s["replicas"]) for s in stages)
    if len(stages) == 1 and devices > 1:
        return (f"data parallel: the whole model on each of {devices} devices, one gradient all-reduce per "
                f"minibatch (no pipeline split is faster on this cluster)" if not plan_json["inputs"].get("num_stages")
                else f"data parallel: the whole model on each of {devices} devices (plan.num_stages=1)")
    if len(stages) > 1 and any(int(s["replicas"]) > 1 for s in stages):
        return "hybrid: pipeline stages, some replicated (data parallel within the stage)"
    return None


def steering_line(pipeline: dict[str, Any]) -> str | None:
    """The user's fixed plan beside the best plan without the constraints (None: nothing fixed)."""
    free = pipeline.get("unconstrained")
    if free is None:
        return None
    names = free["split_points"]
    replicas = f"plan.replicas=[{','.join(str(r) for r in free['replicas'])}]"
    if not names:
        how = f"no split, {replicas}"
    else:
        cuts = f"plan.split_points=[{','.join(names)}]" if all(names) else f"plan.boundaries={free['boundaries']}"
        how = f"{cuts} {replicas}"
    head = f"your split {pipeline['time_per_minibatch_ms']:.4g} ms per minibatch; unconstrained best {free['time_per_minibatch_ms']:.4g} ms"
    if free["faster_pct"] < 0.5:
        return f"{head} ({how}): yours is as fast"
    return f"{head}, {free['faster_pct']:.0f}% faster: {how}"


def plan_notes(plan_json: dict[str, Any]) -> list[str]:
    """What a steered plan tells the user besides its table: the unconstrained best, warnings."""
    line = steering_line(plan_json["pipeline"])
    return ([line] if line else []) + [f"warning: {w}" for w in plan_json.get("warnings", ())]


def search_space_lines(inputs: dict[str, Any]) -> list[str]:
    """A plan that is the best over a restricted space says so (`inputs.search_space`)."""
    space = inputs.get("search_space")
    if not space:
        return []
    return [f"search space: {space.get('note', space.get('method', 'restricted'))} ({space.get('reason', '')})"]


def render_plan(plan: Plan | dict[str, Any], chain: Chain | None, fmt: str = "text") -> str:
    plan_json = plan.to_json() if isinstance(plan, Plan) else plan
    if fmt == "json":
        return canonical_json(plan_json).rstrip("\n")
    if fmt not in TABLE_STYLE:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    bottleneck = plan_json["pipeline"]["bottleneck_stage"]
    rows = []
    for s in plan_json["stages"]:
        p = s["predicted"]
        rows.append([
            f"{s['stage_id']}{BOTTLENECK_MARK if s['stage_id'] == bottleneck else ''}",
            s.get("split_point"),
            _label(chain, s["start"], s["first_node"]),
            _label(chain, s["end"] - 1, s["last_node"]),
            f"[{s['start']}, {s['end']})",
            s["replicas"],
            format_ranks(s["ranks"]),
            p["fwd_ms"], p["bwd_ms"], p.get("optimizer_ms"), p["sync_ms"],
            max(p["comm_in_ms"], p["comm_out_ms"]),
            p["stage_time_ms"], format_bytes(p["total_bytes"]),
        ])
    headers = ["stage", "starts at", "first layer", "last layer", "positions", "replicas", "ranks",
               "fwd ms", "bwd ms", "optim ms", "sync ms", "comm ms", "stage ms", "memory"]
    table = tabulate(rows, headers=headers, tablefmt=TABLE_STYLE[fmt], floatfmt=".4g", missingval="-")
    inputs = plan_json.get("inputs", {})
    split = " with split backward" if inputs.get("split_backward") else ""
    split += " (weight gradients merged per chunk)" if split and inputs.get("merge_weight_grads") else ""
    virtual = int(inputs.get("virtual_stages", 1))
    shape = (f"{len(rows)} stages" if virtual == 1 else  # virtual stages: each stage is a chunk
             f"{len(rows)} stages (chunks, {virtual} per device on {len(rows) // virtual} devices)")
    head = (f"plan: {shape}, schedule {inputs.get('schedule', '?')}{split}, "
            f"cost model {inputs.get('cost_model', '?')} ({BOTTLENECK_MARK} = bottleneck)")
    shape_note = shape_line(plan_json)
    lines = [summary_line(plan_json["pipeline"]), *([shape_note] if shape_note else []), *plan_notes(plan_json),
             *search_space_lines(inputs)]
    stale = staleness_line(plan_json)
    return f"{head}\n\n{table}\n\n" + "\n".join(lines + ([stale] if stale else []))


def staleness_line(plan_json: dict[str, Any]) -> str | None:
    """The update delay of each stage under the plan's schedule (without vertical sync), or
    None when the plan does not say its schedule."""
    inputs, stages = plan_json.get("inputs", {}), sorted(plan_json["stages"], key=lambda s: s["stage_id"])
    if inputs.get("schedule") not in SCHEDULES or not stages:
        return None
    try:
        delays = ", ".join(str(d) for d in stage_delays(inputs["schedule"], int(inputs.get("num_microbatches", 1)),
                                                        [int(s["replicas"]) for s in stages]))
    except UserError:  # a plan the runtime refuses (e.g. replicas not dividing the microbatches)
        return None
    return f"staleness: weights lag {delays} optimizer steps behind (stages 0..{len(stages) - 1}, {inputs['schedule']})"


CHOSEN_MARK = "<-"


def render_front(plan_json: dict[str, Any], fmt: str = "text") -> str:
    """`pd plan --pareto`: one row per configuration on the plan's Pareto front (`search`), the
    chosen one marked; json: the `search` block."""
    search = plan_json.get("search")
    if search is None:
        raise UserError("this plan did not search the configuration (no `search` in plan.json)",
                        hint="set schedule.name=auto or schedule.num_microbatches=auto, or pass --pareto")
    if fmt == "json":
        return canonical_json(search).rstrip("\n")
    rows = []
    for k, row in enumerate(search["front"]):
        replicas = row["replicas"]
        shape = f"{len(replicas)} ({'+'.join(str(r) for r in replicas)})"
        rows.append([
            CHOSEN_MARK if k == search["chosen"] else "",
            row["schedule"] + (f" x{row['virtual_stages']}" if row.get("virtual_stages", 1) > 1 else "")
            + (" (split bwd)" if row["split_backward"] else "") + (", recompute" if row.get("recompute") else "")
            + (f", {row['precision']}" if row.get("precision", "fp32") != "fp32" else ""),
            row["num_microbatches"], shape, round(row["throughput_samples_per_s"]), row["time_per_minibatch_ms"],
            format_bytes(row["peak_bytes"]), row["staleness"],
        ])
    headers = ["", "schedule", "M", "stages (replicas)", "samples/s", "ms/minibatch", "peak memory", "staleness"]
    table = tabulate(rows, headers=headers, tablefmt=TABLE_STYLE[fmt], floatfmt=".4g")
    bound = search.get("max_staleness")
    head = (f"Pareto front: {len(rows)} of {search['configurations']} configurations "
            f"({search['without_plan']} had no plan: memory or the schedule's rules); objective {search['objective']}"
            + (f", staleness <= {bound}" if bound is not None else "") + f" ({CHOSEN_MARK} = chosen)")
    return f"{head}\n\n{table}"
