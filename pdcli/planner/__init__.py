"""Planner: cluster topology, cost models, partition search, plan format, plan diff (no torch)."""

from pdcli.planner.diff import PlanDiff, diff_plans, render_diff
from pdcli.planner.make import plan_chain
from pdcli.planner.options import PlanOptions
from pdcli.planner.plan import Plan, Stage
from pdcli.planner.render import render_plan
from pdcli.planner.topology import Level, Topology

__all__ = [
    "Level", "Plan", "PlanDiff", "PlanOptions", "Stage", "Topology",
    "diff_plans", "plan_chain", "render_diff", "render_plan",
]
