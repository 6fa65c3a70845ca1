"""A profile measured at several batch sizes, and the chain priced at any of them (pure, no torch).

A chain's times are those of its `meta.batch_size` rows; the planner scales them linearly to
the minibatch. Small microbatches do not run at the rate of large ones (a 32-row matmul on a
CPU runs at a fraction of a 256-row one's rate, and a GPU kernel the same), so a search over
microbatch counts needs each position's time at several sizes: `meta.batch_points` holds them,
and `chain_at_rows` interpolates.

    meta.batch_points = {"rows": [r1, ...], "fwd_ms": [[per position] per size],
                         "bwd_ms": [...], "wgrad_ms": [...]}

`chain_at_rows(chain, rows)` keeps every byte count (they scale linearly with rows, exactly)
and replaces each position's times by its time at `rows` scaled to `meta.batch_size` rows, so
that the planner's linear batch scale gives the time of a minibatch of microbatches of `rows`.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Sequence

from pdcli.profiler.chain import Chain

BATCH_POINTS_META = "batch_points"
PRECISION_META = "precision_time"
"""`meta.precision_time`: the whole model's training step under each precision's autocast, as a
factor on its fp32 time, at each microbatch size measured (`pd profile` measures it when
`train.precision` is searched): `{"rows": [r1, ...], "factors": {"fp32": [1.0, ...], "bf16":
[...]}}`. The factor moves with the rows: a bf16 matmul gains more over fp32 on many rows than on
a few."""
TIME_FIELDS = ("fwd_ms", "bwd_ms", "wgrad_ms")


def batch_points_json(points: dict[int, Chain]) -> dict[str, Any]:
    """`meta.batch_points` from chains of the same model profiled at other sizes (rows -> chain)."""
    rows = sorted(points)
    return {"rows": rows, **{f: [[float(getattr(n, f)) for n in points[r].nodes] for r in rows] for f in TIME_FIELDS}}


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at x, piecewise linear through the sorted points (xs, ys); outside them, proportional
    to x from the nearest point (the linear batch scale of a single measurement)."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    k = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def chain_at_rows(chain: Chain, rows: int) -> Chain:
    """`chain` priced for microbatches of `rows` samples (unchanged without `meta.batch_points`)."""
    own = chain.meta.get("batch_size")
    points = chain.meta.get(BATCH_POINTS_META)
    if not points or not own or rows == own:
        return chain
    table: dict[int, dict[str, list[float]]] = {
        int(r): {f: list(points[f][k]) for f in TIME_FIELDS} for k, r in enumerate(points["rows"])}
    table[int(own)] = {f: [float(getattr(n, f)) for n in chain.nodes] for f in TIME_FIELDS}
    xs = sorted(table)
    nodes = []
    for i, node in enumerate(chain.nodes):
        values = {f: interpolate(xs, [table[x][f][i] for x in xs], rows) * own / rows for f in TIME_FIELDS}
        nodes.append(dataclasses.replace(node, **values))
    return dataclasses.replace(chain, nodes=tuple(nodes))


def with_merged_weight_grads(priced: Chain, at_minibatch: Chain) -> Chain:
    """`priced` (a chain priced for its microbatches) with each position's weight gradients at
    the rate of `at_minibatch` (the same profile priced at the minibatch's rows): what a run with
    `schedule.merge_weight_grads` pays, one matmul per layer over every microbatch's rows at the
    flush, as the planner counts it (M of these W's). A position's `bwd_ms` holds its `wgrad_ms`
    (the split Backward is their difference), so it moves with it."""
    if at_minibatch is priced:  # one price for every size (no `meta.batch_points`)
        return priced
    nodes = tuple(dataclasses.replace(node, wgrad_ms=merged.wgrad_ms,
                                      bwd_ms=node.bwd_ms - node.wgrad_ms + merged.wgrad_ms)
                  for node, merged in zip(priced.nodes, at_minibatch.nodes, strict=True))
    return dataclasses.replace(priced, nodes=nodes)


def chain_of_run(chain: Chain, rows: int, precision: str, minibatch_rows: int | None = None) -> Chain:
    """`chain` priced as the planner prices a run of microbatches of `rows` at `precision`;
    `minibatch_rows` (its weight gradients merged per chunk): their W's at that many rows'
    rate (`with_merged_weight_grads`)."""
    priced = chain_at_rows(chain, rows)
    if minibatch_rows is not None:
        priced = with_merged_weight_grads(priced, chain_at_rows(chain, minibatch_rows))
    return chain_at_precision(priced, precision, rows)


def precision_time_json(factors: dict[int, dict[str, float]]) -> dict[str, Any]:
    """`meta.precision_time` from each measured microbatch size's factors (rows -> precision -> factor)."""
    rows = sorted(factors)
    precisions = sorted({p for by in factors.values() for p in by})
    return {"rows": rows, "factors": {p: [float(factors[r][p]) for r in rows] for p in precisions}}


def measured_precisions(meta: dict[str, Any]) -> tuple[str, ...]:
    """The precisions `meta.precision_time` prices (none for a profile without it, or of an older pd)."""
    table = meta.get(PRECISION_META)
    return tuple(table["factors"]) if isinstance(table, dict) and isinstance(table.get("factors"), dict) else ()


def precision_factor(meta: dict[str, Any], precision: str, rows: int) -> float | None:
    """The step's time at `precision` as a factor on fp32's for microbatches of `rows` samples:
    piecewise linear between the measured sizes, the nearest one's beyond them (None: not measured)."""
    if precision not in measured_precisions(meta):
        return None
    table = meta[PRECISION_META]
    xs, ys = [float(r) for r in table["rows"]], [float(f) for f in table["factors"][precision]]
    return interpolate(xs, ys, min(max(float(rows), xs[0]), xs[-1]))


def chain_at_precision(chain: Chain, precision: str, rows: int) -> Chain:
    """`chain`, priced for microbatches of `rows` samples, priced at `precision`: every position's
    times by the whole step's measured factor at those rows (unchanged for a precision the
    profile did not measure, and fp32)."""
    factor = precision_factor(chain.meta, precision, rows)
    if not factor or factor == 1.0:
        return chain
    nodes = tuple(dataclasses.replace(n, **{f: float(getattr(n, f)) * factor for f in TIME_FIELDS}) for n in chain.nodes)
    return dataclasses.replace(chain, nodes=nodes)


def point_rows(batch_size: int, microbatches: Sequence[int], profiled: int, most: int = 4) -> list[int]:
    """Microbatch sizes to measure besides `profiled` so that every count in `microbatches`
    interpolates: the smallest and the largest, and between them up to `most` in all, evenly
    spaced in the sorted list of sizes (the divisors of a power of two: evenly on a log scale)."""
    sizes = sorted({batch_size // m for m in microbatches if batch_size % m == 0})
    if len(sizes) <= most:
        chosen = sizes
    else:
        step = (len(sizes) - 1) / (most - 1)
        chosen = sorted({sizes[round(k * step)] for k in range(most)})
    return [r for r in chosen if r != profiled]
