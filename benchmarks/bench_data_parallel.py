"""pd against data parallelism (torch DDP) on two hosts joined by a shaped link.

Two network namespaces joined by a veth pair are the two hosts (`pdcli.testing.netns`); a
token-bucket filter on both ends (`tc ... tbf rate R`) makes the link R Mbit/s each way. Per
rate and model, side by side in one run:

- `ddp`: torch DistributedDataParallel, gloo, one process per host (`_ddp_train.py`, started by
  torchrun as its users start it), the same model, initial weights, data, minibatch and optimizer;
- `pd_dp`: pd forced to pure data parallelism, one stage replicated on both hosts (1f1b with one
  microbatch per replica: one all-reduce and one step per minibatch, DDP's semantics);
- `pd_pipeline`: the recipe's own pipeline (its schedule, its stage count);
- `pd_pick`: what `pd plan` picks for that cluster when stages, replication, schedule and
  microbatches are free (`~plan.num_stages schedule.name=auto schedule.num_microbatches=auto`),
  on both hosts (`plan.use_fewer_devices=false`: `--nnodes 2` runs a plan of both).

Every pd row runs `pd train --nnodes 2` on both hosts; its cluster is one device per host,
the hosts joined at the link's measured goodput (`cluster.levels`), and its profile is one profile of the
model measured once on this machine (seeded into each run directory, as `pd profile` would
write it there).

Per row: samples/s in the steady state (the second half of the run, intervals holding an
evaluation left out), the bytes that crossed the link per minibatch (the veth's counters over
the same intervals, both directions), held-out accuracy over wall time and the time to a target
(from the start of the training loop), and `pd plan`'s predictions: the plan's time for each pd
row, and for `ddp` the data-parallel time the plans print ("... x data parallel",
`pdcli.planner.evaluate.data_parallel_eval`).

    python benchmarks/bench_data_parallel.py                       # every rate and model (~15 min)
    python benchmarks/bench_data_parallel.py --rates 50 --models mlp --rows ddp,pd_pick
    python benchmarks/bench_data_parallel.py --rates 1000,unshaped --rounds 3      # medians of 3, interleaved
    python benchmarks/bench_data_parallel.py --rates 50 --rows ddp,pd_pipeline --steps 20 --set profile.runtime_probe=false

Needs root and iproute2 (`ip`, `tc`); nothing is asserted, the numbers are printed and
written as JSON. The namespaces go away when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdcli.testing.netns import HostPair, Sampler, available, bytes_at  # noqa: E402

BIN = Path(sys.executable).parent
RATES_MBIT: tuple[float | None, ...] = (25, 50, 200, 1000, None)
"""None: the link unshaped."""
ROWS = ("ddp", "pd_dp", "pd_pipeline", "pd_pick")
RUN_TIMEOUT_S = 900.0
INNER_BANDWIDTH_BYTES_PER_S = 1e10
"""Within a host (one device each here: never used but required by `cluster.levels`)."""
UNSHAPED_PROBE_BYTES = 64 * 2**20
GOODPUT_PROBE_S = 1.5
"""A shaped link's goodput probe sends about this long at its rate."""
MBIT_BYTES = 1e6 / 8


@dataclass(frozen=True)
class Case:
    """One model: its recipe, what the rows share, how long each runs."""

    recipe: str
    overrides: tuple[str, ...]
    steps: int
    log_every: int
    eval_every: int = 0
    target_accuracy: float | None = None
    pipeline: tuple[str, ...] = ()
    """Overrides that make the recipe's pipeline the `pd_pipeline` row."""


CASES: dict[str, Case] = {
    # the quickstart: an 8-layer MLP (0.49 MB of weights) on the digits, pipedream over 2 stages
    "mlp": Case("recipes/quickstart.yaml", (), steps=150, log_every=5, eval_every=10, target_accuracy=0.95),
    # VGG-16 at 1/4 width with 1024-wide fully connected layers: 8.5 MB of weights, 55% of them in
    # the classifier, ~0.17 s per 64-image step on one core; synthetic images (throughput only)
    "vgg": Case("recipes/vgg16.yaml", ("model.kwargs.width=0.25", "model.kwargs.fc_hidden=1024", "data.batch_size=64",
                                       "optim.momentum=0.0"),
                steps=30, log_every=5, pipeline=("plan.num_stages=2",)),
}


def row_overrides(row: str, case: Case) -> list[str]:
    if row == "pd_dp":
        return ["plan.num_stages=1", "plan.replicas=[2]", "schedule.name=1f1b", "schedule.num_microbatches=2",
                "schedule.split_backward=false"]
    if row == "pd_pick":
        return ["~plan.num_stages", "schedule.name=auto", "schedule.num_microbatches=auto", "plan.use_fewer_devices=false"]
    if row == "pd_pipeline":
        return list(case.pipeline)
    return []


def cluster_override(bandwidth_bytes_per_s: float) -> str:
    return (f"cluster.levels=[{{devices: 1, bandwidth_bytes_per_s: {INNER_BANDWIDTH_BYTES_PER_S:g}}}, "
            f"{{devices: 2, bandwidth_bytes_per_s: {bandwidth_bytes_per_s:.6g}}}]")


def common_overrides(case: Case, root: Path, bandwidth_bytes_per_s: float) -> list[str]:
    return [*case.overrides, f"run.root={root}", "run.name=run", cluster_override(bandwidth_bytes_per_s),
            "cluster.device=cpu", f"train.steps={case.steps}", f"train.log_every={case.log_every}",
            f"train.eval_every={case.eval_every}", "train.threads_per_worker=1", "train.tensorboard=false"]


# ---- processes -------------------------------------------------------------------------

class RunFailed(RuntimeError):
    pass


def run_pair(commands: Sequence[list[str]], env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S) -> list[str]:
    """Run one command per host at once; their stderr. Every process group is killed on the way out."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True) for cmd in commands]
    errs = [""] * len(procs)
    try:
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(procs):
            _, errs[i] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"timed out after {timeout_s:.0f} s") from e
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RunFailed("; ".join(f"host {i} exited {code}: {' | '.join(errs[i].strip().splitlines()[-3:])}"
                                  for i, code in bad))
    return errs


JOB_SECRET = secrets.token_hex(32)
"""The secret every `pd train --nnodes 2` of this benchmark is given (`PD_JOB_SECRET`)."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PD_JOB_SECRET", JOB_SECRET)  # both hosts' nodes: the same secret, out of band
    return env


_ports = iter(range(29600, 30600))


# ---- measuring a record ----------------------------------------------------------------

@dataclass
class Record:
    """What one run left: (minibatches done, unix time) points, evaluations, its loop's start."""

    points: list[tuple[int, float]]
    evals: list[tuple[int, float, float]]
    """(after minibatches, unix time, held-out accuracy)."""
    start_time: float
    batch_size: int
    extra: dict[str, Any] = field(default_factory=dict)


def steady(record: Record, samples: Sequence[tuple[float, int, int]]) -> dict[str, float]:
    """samples/s and link bytes per minibatch over the second half's intervals that hold no
    evaluation (one after minibatch e runs in the interval that starts at e)."""
    eval_steps = {e[0] for e in record.evals}
    pts = sorted(record.points)
    half = pts[-1][0] / 2
    steps = seconds = moved = 0.0
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if a < half or a in eval_steps:
            continue
        steps += b - a
        seconds += tb - ta
        if samples:
            moved += bytes_at(samples, tb) - bytes_at(samples, ta)
    if steps == 0 or seconds <= 0:
        raise RunFailed("no steady interval to measure")
    return {"samples_per_s": record.batch_size * steps / seconds, "ms_per_minibatch": 1e3 * seconds / steps,
            "bytes_per_minibatch": moved / steps if samples else float("nan")}


def accuracy_curve(record: Record, target: float | None) -> dict[str, Any]:
    curve = [(round(t - record.start_time, 3), round(acc, 4)) for _, t, acc in sorted(record.evals)]
    reached = next((t for t, acc in curve if target is not None and acc >= target), None)
    return {"accuracy_over_time": curve, "time_to_target_s": reached,
            "final_eval_accuracy": curve[-1][1] if curve else None}


def ddp_record(path: Path, batch_size: int) -> Record:
    d = json.loads(path.read_text())
    points = [(0, d["start_time"])] + [(k + 1, t) for k, t in enumerate(d["step_times"])]
    return Record(points, [(e["step"], e["time"], e["eval_accuracy"]) for e in d["evals"]], d["start_time"], batch_size)


def pd_record(run_dirs: Sequence[Path], batch_size: int) -> Record:
    """From the run directory that holds the summary (the last stage's node)."""
    for run in run_dirs:
        summary_path = run / "train" / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            lines = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
            points = [(0, summary["start_time"])] + [(x["step"], x["time"]) for x in lines
                                                      if "loss" in x and not x.get("final")]
            evals = [(e["step"], e["time"], e["eval_accuracy"]) for e in summary.get("evals", []) if "eval_accuracy" in e]
            return Record(points, evals, summary["start_time"], batch_size)
    raise RunFailed(f"no summary.json in {', '.join(map(str, run_dirs))}")


# ---- the rows --------------------------------------------------------------------------

def profile_once(case_name: str, case: Case, work: Path, bandwidth: float) -> Any:
    """The model's profile, measured once (with the pick's search: its batch points) on this host."""
    from pdcli.steps.profile import load_profile
    from pdcli.rundir import RunDir

    root = work / case_name / "profile"
    overrides = [*common_overrides(case, root, bandwidth), *row_overrides("pd_pick", case)]
    started = time.monotonic()
    done = subprocess.run([str(BIN / "pd"), "profile", case.recipe, *overrides], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RunFailed(f"pd profile: {done.stderr.strip()[-500:]}")
    print(f"[{case_name}] profiled in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return load_profile(RunDir(root / "run"))


def seed(case: Case, overrides: list[str], chain: Any) -> None:
    from pdcli.config import load_config
    from pdcli.steps.profile import seed_profile

    cfg = load_config(str(REPO / case.recipe), overrides).config
    seed_profile(cfg, chain)


def run_ddp(pair: HostPair, case: Case, root: Path, bandwidth: float) -> tuple[Record, list[tuple[float, int, int]]]:
    overrides = common_overrides(case, root, bandwidth)
    out = root / "ddp.json"
    root.mkdir(parents=True, exist_ok=True)
    port = str(next(_ports))
    env = child_env()
    commands = []
    for i, host in enumerate(pair.hosts):
        commands.append([*host.prefix(), "env", f"GLOO_SOCKET_IFNAME={host.dev}", str(BIN / "torchrun"),
                         "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
                         "--master-addr", pair.hosts[0].addr, "--master-port", port,
                         str(REPO / "benchmarks" / "_ddp_train.py"), str(REPO / case.recipe), *overrides,
                         "--out", str(out), "--eval-every", str(case.eval_every)])
    with pair.sample() as sampler:
        run_pair(commands, env)
        samples = sampler.stop()
    from pdcli.config import load_config

    batch = load_config(str(REPO / case.recipe), overrides).config.data.batch_size
    return ddp_record(out, batch), samples


def run_pd(pair: HostPair, case: Case, row: str, root: Path, bandwidth: float, chain: Any
           ) -> tuple[Record, list[tuple[float, int, int]], dict[str, Any]]:
    roots = [root / f"node{i}" for i in range(2)]
    overrides = [*common_overrides(case, roots[0], bandwidth), *row_overrides(row, case)]
    seed(case, overrides, chain)
    port = str(next(_ports))
    commands = []
    for i, host in enumerate(pair.hosts):
        mine = [o if not o.startswith("run.root=") else f"run.root={roots[i]}" for o in overrides]
        commands.append([*host.prefix(), str(BIN / "pd"), "train", str(REPO / case.recipe), *mine,
                         "--nnodes", "2", "--node-rank", str(i), "--master-addr", pair.hosts[0].addr,
                         "--master-port", port])
    with pair.sample() as sampler:
        run_pair(commands, child_env())
        samples = sampler.stop()
    plan = json.loads((roots[0] / "run" / "plan.json").read_text())
    config = (roots[0] / "run" / "config.yaml").read_text()
    from pdcli.config import load_config

    batch = load_config(str(REPO / case.recipe), overrides).config.data.batch_size
    return pd_record([r / "run" for r in roots], batch), samples, {"plan": plan_facts(plan), "config": config}


def plan_facts(plan: dict[str, Any]) -> dict[str, Any]:
    p = plan["pipeline"]
    stages = plan["stages"]
    search = plan.get("search") or {}
    return {
        "predicted_ms": p["time_per_minibatch_ms"],
        "predicted_data_parallel_ms": p["data_parallel_time_per_minibatch_ms"],
        "speedup_over_data_parallel": p["speedup_over_data_parallel"],
        "stages": [s["replicas"] for s in stages],
        "schedule": plan["inputs"]["schedule"],
        "num_microbatches": plan["inputs"]["num_microbatches"],
        "searched": bool(search),
    }


def measure_goodput(pair: HostPair, rate_mbit: float | None) -> float:
    """TCP goodput of the link as shaped now, bytes/s (host 0 to host 1, one stream): about
    GOODPUT_PROBE_S of bytes at the rate, UNSHAPED_PROBE_BYTES unshaped."""
    a, b = pair.hosts
    port = next(_ports)
    size = UNSHAPED_PROBE_BYTES if rate_mbit is None else max(1 << 20, int(rate_mbit * MBIT_BYTES * GOODPUT_PROBE_S))
    sink = subprocess.Popen([*b.prefix(), sys.executable, "-c",
                             "import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                             f"s.bind(('{b.addr}',{port}));s.listen(1);print('up',flush=True);c,_=s.accept()\n"
                             "while c.recv(1<<20): pass\nc.sendall(b'k')"], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    sink.stdout.readline()
    source = subprocess.run([*a.prefix(), sys.executable, "-c",
                             f"import socket,time\ns=socket.create_connection(('{b.addr}',{port}))\nt=time.perf_counter()\n"
                             f"s.sendall(bytes({size}));s.shutdown(socket.SHUT_WR);s.recv(1)\n"
                             "print(time.perf_counter()-t)"], capture_output=True, text=True, timeout=60)
    sink.wait(timeout=60)
    return size / float(source.stdout.strip())


def median_round(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row's result from its rounds: the round of median samples/s (the lower of two), with
    every round's samples/s beside it (`rounds_samples_per_s`); a failure when every round failed."""
    done = sorted((r for r in rounds if "error" not in r), key=lambda r: r["samples_per_s"])
    if not done:
        return rounds[-1]
    kept = dict(done[(len(done) - 1) // 2])
    if len(rounds) > 1:
        kept["rounds_samples_per_s"] = [r.get("samples_per_s") for r in rounds]
    return kept


def run_rate(pair: HostPair, rate: float | None, case_name: str, case: Case, rows: Sequence[str], work: Path,
             chain: Any, unshaped_bw: float, rounds: int = 1) -> dict[str, Any]:
    """Every row at one rate, `rounds` times over (the rows interleaved, so a slow spell of the
    host falls on all of them; each row keeps its median round: `median_round`). The plans'
    cluster has the link's measured goodput (what `pd plan --calibrate` adopts from a run's link
    measurement), not its nominal rate: TCP/IP headers and the shaper take 4-8% of a tbf link's rate."""
    pair.shape(rate)
    label = "unshaped" if rate is None else f"{rate:g}"
    bandwidth = unshaped_bw if rate is None else measure_goodput(pair, rate)
    print(f"[{case_name} @ {label} Mbit/s] goodput {bandwidth / 1e6:.3g} MB/s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rate_mbit": rate, "configured_bandwidth_bytes_per_s": bandwidth, "rows": {}}
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    for k in range(rounds):
        for row in rows:
            root = work / case_name / label / (row if rounds == 1 else f"{row}.{k}")
            started = time.monotonic()
            try:
                if row == "ddp":
                    record, samples = run_ddp(pair, case, root, bandwidth)
                    facts: dict[str, Any] = {}
                else:
                    record, samples, facts = run_pd(pair, case, row, root, bandwidth, chain)
                result = {**steady(record, samples), **accuracy_curve(record, case.target_accuracy), **facts,
                          "wall_s": time.monotonic() - started}
            except RunFailed as e:
                result = {"error": str(e), "wall_s": time.monotonic() - started}
            results[row].append(result)
            shown = result.get("error") or (f"{result['samples_per_s']:.0f} samples/s, "
                                            f"{result['bytes_per_minibatch'] / 1e3:.1f} KB/minibatch, "
                                            f"to target {result['time_to_target_s']}")
            print(f"[{case_name} @ {label} Mbit/s] {row}: {shown} ({result['wall_s']:.0f} s)", file=sys.stderr,
                  flush=True)
    out["rows"] = {row: median_round(results[row]) for row in rows}
    plans = [r["plan"] for r in out["rows"].values() if r.get("plan")]
    if plans and "ddp" in out["rows"] and "error" not in out["rows"]["ddp"]:  # every plan prices DDP alike
        out["rows"]["ddp"]["predicted_ms"] = plans[0]["predicted_data_parallel_ms"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join("unshaped" if r is None else f"{r:g}" for r in RATES_MBIT),
                        help="Mbit/s, comma-separated; `unshaped` for the bare link")
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--steps", type=int, default=None, help="minibatches per run (default: each model's)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every row per rate, interleaved; the median kept")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every row and the profile (repeatable), e.g. profile.runtime_probe=false")
    parser.add_argument("--work", default=str(REPO / "runs" / "benchmarks" / "data_parallel"))
    parser.add_argument("--out", default=None, help="the JSON results (default: WORK/results.json)")
    args = parser.parse_args(argv)
    why = available()
    if why:
        print(f"bench_data_parallel: {why}", file=sys.stderr)
        return 2
    rates = [None if r.strip() == "unshaped" else float(r) for r in args.rates.split(",")]
    rows = [r.strip() for r in args.rows.split(",")]
    work = Path(args.work)
    results: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "date": date.today().isoformat(),
                               "torch": _torch_version(), "rounds": args.rounds, "cases": {}}
    started = time.monotonic()
    with HostPair() as pair:
        unshaped_bw = measure_goodput(pair, None)
        results["unshaped_bandwidth_bytes_per_s"] = unshaped_bw
        print(f"unshaped link: {unshaped_bw / 1e6:.0f} MB/s", file=sys.stderr, flush=True)
        for name in args.models.split(","):
            case = CASES[name.strip()]
            if args.steps:
                case = Case(**{**case.__dict__, "steps": args.steps})
            if args.set:
                case = Case(**{**case.__dict__, "overrides": (*case.overrides, *args.set)})
            chain = profile_once(name, case, work, unshaped_bw)
            per_rate = []
            for rate in rates:
                per_rate.append(run_rate(pair, rate, name, case, rows, work, chain, unshaped_bw, args.rounds))
            results["cases"][name] = {"recipe": case.recipe, "overrides": list(case.overrides), "steps": case.steps,
                                      "target_accuracy": case.target_accuracy, "rates": per_rate}
    results["wall_s"] = time.monotonic() - started
    out = Path(args.out) if args.out else work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(render_table(results))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def render_table(results: dict[str, Any]) -> str:
    from tabulate import tabulate

    lines = []
    for name, case in results["cases"].items():
        rows = []
        for rate in case["rates"]:
            label = "unshaped" if rate["rate_mbit"] is None else f"{rate['rate_mbit']:g}"
            for row, r in rate["rows"].items():
                if "error" in r:
                    rows.append([label, row, r["error"][:60]])
                    continue
                pred = r.get("predicted_ms") or (r.get("plan") or {}).get("predicted_ms")
                rows.append([label, row, f"{r['samples_per_s']:.0f}", f"{r['ms_per_minibatch']:.1f}",
                             f"{pred:.1f}" if pred else "-", f"{r['bytes_per_minibatch'] / 1e3:.1f}",
                             r["time_to_target_s"] if r["time_to_target_s"] is not None else "-",
                             (r.get("plan") or {}).get("stages", "-")])
        lines.append(f"\n{name}\n" + tabulate(rows, headers=["Mbit/s", "row", "samples/s", "ms/minibatch", "predicted ms",
                                                              "KB/minibatch", "s to target", "stages"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
