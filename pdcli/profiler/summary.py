"""Human-readable summary of a profile chain: the costliest layers and the totals (pure, no torch)."""

from __future__ import annotations

from tabulate import tabulate

from pdcli.profiler.chain import Chain

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
BYTES_PER_KIB = 1024
LABEL_COLUMN_CHARS = 52
SHAPE_SEPARATOR = " -> "
"""Between a label's op and its output shape (see `measure.node_label`)."""


def format_bytes(num_bytes: float) -> str:
    """`1536` -> `1.5 KiB` (binary units)."""
    value = float(num_bytes)
    for unit in BYTE_UNITS:
        if abs(value) < BYTES_PER_KIB or unit == BYTE_UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= BYTES_PER_KIB
    raise AssertionError("unreachable")


def _shorten(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def summarize(chain: Chain, top: int = 10) -> str:
    """The `top` layers by forward + backward time, then the totals of the whole chain."""
    ranked = sorted(
        enumerate(chain.nodes), key=lambda item: (-(item[1].fwd_ms + item[1].bwd_ms), item[0])
    )[: max(top, 0)]
    total_ms = sum(n.fwd_ms + n.bwd_ms for n in chain.nodes)
    rows = [
        [
            position,
            _shorten((node.label or node.name).partition(SHAPE_SEPARATOR)[0], LABEL_COLUMN_CHARS),
            (node.label or "").partition(SHAPE_SEPARATOR)[2],
            node.fwd_ms,
            node.bwd_ms,
            100 * (node.fwd_ms + node.bwd_ms) / total_ms if total_ms > 0 else None,
            format_bytes(node.activation_bytes),
            format_bytes(node.parameter_bytes),
        ]
        for position, node in ranked
    ]
    layers = tabulate(
        rows,
        headers=["pos", "layer", "output", "fwd ms", "bwd ms", "% time", "activations", "parameters"],
        floatfmt=("", "", "", ".3f", ".3f", ".1f", "", ""),
        missingval="-",
    )

    meta = chain.meta
    calibration = meta.get("calibration") or {}
    ratio = calibration.get("ratio")
    step = (
        f"{calibration['step_ms']:.3f} ms measured = {ratio:.2f} x the sum of the layers"
        if ratio is not None and "step_ms" in calibration
        else "not measured"
    )
    optimizer = meta.get("optimizer") or {}
    optimizer_row = (
        f"{sum(n.optimizer_ms for n in chain.nodes):.3f} ms per update summed over the positions "
        f"({optimizer.get('name') or '?'}; fixed cost {optimizer.get('step_overhead_ms', 0.0):.3f} ms a step), "
        f"state {format_bytes(sum(n.optimizer_state_bytes for n in chain.nodes))}"
        if optimizer
        else "not measured"
    )
    totals = tabulate(
        [
            ["positions", len(chain)],
            ["forward", f"{sum(n.fwd_ms for n in chain.nodes):.3f} ms"],
            ["backward", f"{sum(n.bwd_ms for n in chain.nodes):.3f} ms"],
            ["weight grads", f"{sum(n.wgrad_ms for n in chain.nodes):.3f} ms of the backward (nn.Linear layers: "
                             f"a split backward runs them later, in WeightGrads)"],
            ["activations", format_bytes(sum(n.activation_bytes for n in chain.nodes))],
            ["parameters", format_bytes(sum(n.parameter_bytes for n in chain.nodes))],
            ["model inputs", format_bytes(chain.input_bytes)],
            ["largest cut", format_bytes(max(chain.cut_bytes, default=0))],
            ["whole step", step],
            ["optimizer", optimizer_row],
        ],
        tablefmt="plain",
    )
    runtime = runtime_rows(meta.get("runtime"))
    if runtime:
        totals += "\n\nwhat the runtime pays per action (runtime probe: real stages run by its executor; " \
                  "ms = scale x profiled ms + fixed ms)\n" + tabulate(runtime, tablefmt="plain", disable_numparse=True)
        sources = meta["runtime"].get("sources") or {}
        precision = sources.get("precision")
        if precision and precision != "fp32":
            totals += (f"\nthe layers above are timed without autocast; the probe ran them under {precision} "
                       f"autocast, as training will: its scales price them at {precision}")
        probe = sources.get("pipeline_probe")
        if probe:
            totals += f"\npipeline probe: {probe}"
        sharing = sources.get("shared_probe")
        if sharing:
            totals += f"\nworkers sharing cores: {sharing}"
    where = ", ".join(
        f"{key} {meta[key]}" for key in ("model", "device", "batch_size", "dtype") if key in meta
    )
    title = f"top {len(rows)} of {len(chain)} positions by forward + backward time"
    return "\n".join([f"{title}" + (f" ({where})" if where else ""), layers, "", totals])


def runtime_rows(obj: object) -> list[list[str]]:
    """The runtime probe's costs (`meta.runtime`) as rows; [] when not measured."""
    if not isinstance(obj, dict) or "modes" not in obj:
        return []

    def affine(a: dict) -> str:
        return f"{a.get('scale', 0.0):.2f} x + {a.get('fixed_ms', 0.0):.3f} ms"

    rows = []
    for mode, label in (("stashed", "pipedream/2bw"), ("direct", "gpipe/1f1b")):
        m = obj["modes"].get(mode)
        if m:
            rows.append([f"{label}", f"Forward {affine(m['forward'])}", f"Backward {affine(m['backward'])}",
                         f"WeightGrads {affine(m['wgrad'])}", f"update {affine(m['update'])}"])
    rows.append(["loss", f"forward {obj.get('loss_fwd_ms', 0.0):.3f} ms", f"backward {obj.get('loss_bwd_ms', 0.0):.3f} ms",
                 "data", f"{obj.get('load_inputs_ms', 0.0):.3f} ms a minibatch (first stage), "
                         f"{obj.get('load_target_ms', 0.0):.3f} ms (last)"])
    per_kib = 1024.0
    send, recv = obj.get("send", {}), obj.get("recv", {})
    rows.append(["messages", f"pack {send.get('fixed_ms', 0.0):.3f} ms + {send.get('scale', 0.0) * per_kib * 1e3:.2f} us/KiB",
                 f"unpack {recv.get('fixed_ms', 0.0):.3f} ms + {recv.get('scale', 0.0) * per_kib * 1e3:.2f} us/KiB",
                 "interpreter", f"{obj.get('gap_ms', 0.0) * 1e3:.1f} us between actions"])
    latency, bw = obj.get("latency_ms"), obj.get("bandwidth_bytes_per_s")
    rows.append(["transport", str(obj.get("transport") or "not measured"),
                 f"latency {latency:.3f} ms" if latency is not None else "latency -",
                 "bandwidth", f"{bw / 1e9:.2f} GB/s" if bw else "- (cluster.levels)"])
    allreduce = obj.get("allreduce")
    rows.append(["all-reduce", f"{allreduce.get('fixed_ms', 0.0):.3f} ms + "
                               f"{allreduce.get('scale', 0.0) * 2 ** 20:.3f} ms/MiB (gloo, 2 processes)"
                 if allreduce else "not measured (ring over cluster.levels)", "", "", ""])
    rows.append(["cores", str(obj.get("cores") or "-"), "", "", ""])
    factors = obj.get("position_scale")
    if factors:
        rows.append(["positions", f"x {min(factors):.2f} to x {max(factors):.2f} on the layers' times",
                     "(each stage of a real run refitted)", "", ""])
    return rows
