"""Several hosts, without processes: the link measurement's arithmetic, its warning and its
adoption by `pd plan --calibrate`; the summary and metrics sent to node 0 through the store."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import HashStore

from pdcli.config.schema import ClusterLevel, Config
from pdcli.rundir import RunDir
from pdcli.runtime import link as L
from pdcli.runtime import results as R
from pdcli.runtime.link import link_record, link_warning
from pdcli.runtime.metrics import METRICS_FILE, SUMMARY_FILE, TRACE_FILE
from pdcli.steps.plan import calibrated_config, plan_inputs_hash

MBIT = 1e6 / 8


def _link(measured: float, configured: float, level: int = 1) -> dict[str, Any]:
    return {"measured_bandwidth_bytes_per_s": measured, "latency_ms": 0.4, "configured_bandwidth_bytes_per_s": configured,
            "level": level, "between": [0, 1], "ranks": [0, 2]}


@pytest.mark.parametrize("rate_mbit", [25, 50, 1000, 100_000])
def test_the_measurement_grows_its_message_and_stays_bounded(rate_mbit: float) -> None:
    """A link of `rate_mbit` with 0.5 ms of latency each way: the sizes tried double from 64 KiB
    until one takes 0.2 s (or reaches the cap); all of them take well under 2 s, and the
    bandwidth comes out as the link's."""
    rate, rtt_s = rate_mbit * MBIT, 1e-3
    tried: list[int] = []

    def time_message(size: int) -> float:
        tried.append(size)
        return rtt_s + size / rate

    size, elapsed_s = L.grow_until_measured(time_message)
    assert tried[0] == L.START_BYTES and all(b == 2 * a for a, b in zip(tried, tried[1:]))
    assert size == tried[-1] and (elapsed_s >= L.GROW_UNTIL_S or size == L.MAX_BYTES)
    assert sum(rtt_s + n / rate for n in tried) < 1.0  # 25 Mbit/s: 64 KiB .. 1 MiB, ~0.67 s
    record = link_record(size, elapsed_s, [rtt_s, 5 * rtt_s, rtt_s], [{"devices": 2, "bandwidth_bytes_per_s": 1e9}],
                         (0, 1), (0, 1))
    assert record["measured_bandwidth_bytes_per_s"] == pytest.approx(rate, rel=1e-6)
    assert record["latency_ms"] == pytest.approx(0.5) and record["level"] == 0 and record["between"] == [0, 1]


def test_a_round_trip_longer_than_the_message_does_not_make_the_rate_unbounded() -> None:
    assert L.bandwidth_bytes_per_s(1000, 0.01, 0.002) == pytest.approx(1000 / 0.008)
    assert L.bandwidth_bytes_per_s(1000, 0.01, 0.5) == pytest.approx(1000 / 0.005)


def test_the_configured_bandwidth_is_the_level_the_two_ranks_span() -> None:
    levels = [ClusterLevel(devices=2, bandwidth_bytes_per_s=1e10), ClusterLevel(devices=2, bandwidth_bytes_per_s=1e8)]
    assert L.spanned_level(levels, 0, 1) == 0  # one node
    assert L.spanned_level(levels, 0, 2) == 1 and L.level_bandwidth(levels, 1) == 1e8
    assert L.spanned_level([{"devices": 2, "bandwidth_bytes_per_s": 1e9}], 0, 1) == 0  # plan.json's dicts
    assert L.spanned_level([{"devices": 2, "bandwidth_bytes_per_s": 1e9}], 0, 2) == 0  # beyond the cluster: the outermost
    planned = [{"devices": 2, "bandwidth_bytes_per_s": 4e8}]  # a calibrated plan's: not the config's
    assert L.planned_levels({"inputs": {"topology": {"levels": planned}}}, levels) == planned
    assert L.planned_levels({"inputs": {}}, levels) == levels


def test_a_link_more_than_2x_off_the_config_is_warned_about_naming_the_key_and_the_fixes() -> None:
    command = "pd plan recipes/quickstart.yaml --calibrate runs/quickstart"
    assert link_warning(_link(5e8, 1e9), command) is None  # exactly 2x: agrees
    assert link_warning(_link(1.9e9, 1e9), command) is None
    slow = link_warning(_link(50 * MBIT, 1e9), command)
    assert slow is not None and slow.startswith("warning: the link between node 0 and node 1 measured 6.25 MB/s (50 Mbit/s)")
    assert "cluster.levels.1.bandwidth_bytes_per_s" in slow and "1e+03 MB/s (8e+03 Mbit/s)" in slow
    assert f"`{command}`" in slow and slow.endswith("cluster.levels.1.bandwidth_bytes_per_s=6.25e+06")
    fast = link_warning(_link(3e9, 1e9), command)
    assert fast is not None and "3x" in fast


def test_report_shows_the_link_and_its_warning() -> None:
    from pdcli.report.render import link_lines

    off = _link(50 * MBIT, 1e9)
    lines = link_lines(SimpleNamespace(measured=SimpleNamespace(link=off), link_warning="warning: x"))  # type: ignore[arg-type]
    assert lines == [f"link {L.link_text(off)}", "warning: x"]
    assert lines[0] == ("link between node 0 and node 1: measured 6.25 MB/s (50 Mbit/s), latency 0.4 ms; "
                        "cluster.levels.1.bandwidth_bytes_per_s is 1e+03 MB/s (8e+03 Mbit/s)")
    assert link_lines(SimpleNamespace(measured=SimpleNamespace(link=None), link_warning=None)) == []  # type: ignore[arg-type]


def test_calibration_adopts_the_measured_bandwidth_of_that_level_only() -> None:
    cfg = Config()
    cfg.cluster.levels = [ClusterLevel(devices=2, bandwidth_bytes_per_s=1e10), ClusterLevel(devices=2, bandwidth_bytes_per_s=1e9)]
    calibration = {"runtime": {}, "link": _link(6.25e6, 1e9, level=1)}
    adopted = calibrated_config(cfg, calibration)
    assert [lv.bandwidth_bytes_per_s for lv in adopted.cluster.levels] == [1e10, 6.25e6]
    assert [lv.devices for lv in adopted.cluster.levels] == [2, 2]
    assert cfg.cluster.levels[1].bandwidth_bytes_per_s == 1e9  # the config itself is left alone
    assert calibrated_config(cfg, {"runtime": {}}) is cfg and calibrated_config(cfg, None) is cfg
    assert plan_inputs_hash(adopted, "p", calibration) != plan_inputs_hash(cfg, "p", calibration)  # re-plans


def test_plan_calibrate_records_the_link_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from pdcli.commands.plan import write_calibration
    from pdcli.planner.runtime_costs import RuntimeCosts
    from pdcli.report import calibrate
    from pdcli.steps.plan import CALIBRATION, profile_sha256, read_calibration

    run = RunDir(tmp_path / "run").create()
    run.write_json("profile.json", {"nodes": 1}, "in")
    trained = tmp_path / "trained"
    (trained / "train").mkdir(parents=True)
    (trained / "train" / L.LINK_FILE).write_text(json.dumps(_link(6.25e6, 1e9, level=0)))
    monkeypatch.setattr(RuntimeCosts, "from_meta", staticmethod(lambda meta: object()))
    monkeypatch.setattr(calibrate, "calibrate_from_run", lambda *a: (SimpleNamespace(to_json=lambda: {"fitted": 1}), {}))
    write_calibration(run, SimpleNamespace(meta={}), trained)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert (f"calibration: cluster.levels.0.bandwidth_bytes_per_s 1e+09 -> 6.25e+06, the link the run measured between "
            f"node 0 and node 1 ({trained / 'train' / L.LINK_FILE})") in err
    saved = read_calibration(run, profile_sha256(run))
    assert saved is not None and saved["link"]["measured_bandwidth_bytes_per_s"] == 6.25e6
    cfg = Config()
    assert calibrated_config(cfg, saved).cluster.levels[0].bandwidth_bytes_per_s == 6.25e6
    (trained / "train" / L.LINK_FILE).unlink()  # a run on one host: no link, nothing adopted
    write_calibration(run, SimpleNamespace(meta={}), trained)  # type: ignore[arg-type]
    assert "link" not in json.loads((run / CALIBRATION).read_text()) and "cluster.levels" not in capsys.readouterr().err


# ---- the summary and metrics reach node 0 ----------------------------------------------


def _train_dir(root: Path) -> Path:
    train = root / "train"
    train.mkdir(parents=True)
    (train / SUMMARY_FILE).write_text(json.dumps({"final_loss": 0.5, "samples_per_s": 100.0}))
    (train / METRICS_FILE).write_text('{"step": 4, "loss": 1.0}\n{"step": 8, "loss": 0.5}\n')
    (train / TRACE_FILE).write_text('{"traceEvents": []}')
    return train


def test_node_0_gets_the_summary_metrics_and_trace_byte_for_byte(tmp_path: Path) -> None:
    store = HashStore()
    theirs = _train_dir(tmp_path / "node1")
    assert R.publish_results(store, theirs, node=1) == []
    mine = tmp_path / "node0" / "train"
    mine.mkdir(parents=True)
    assert R.receive_results(store, mine, node=1, timeout_s=5) == []
    for name in R.RESULT_FILES:
        assert (mine / name).read_bytes() == (theirs / name).read_bytes()


def test_node_0_refuses_results_too_large_tampered_late_or_of_another_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = _train_dir(tmp_path / "node1")
    mine = tmp_path / "node0" / "train"
    mine.mkdir(parents=True)
    with pytest.raises(R.ResultsNotReceived, match=r"node 1 did not send the summary and metrics within 0.1 s "
                                                    r"\(train.timeout_s, DistStoreError\); node 1's run directory holds them"):
        R.receive_results(HashStore(), mine, node=1, timeout_s=0.1)
    other = HashStore()
    R.publish_results(other, theirs, node=2)
    with pytest.raises(R.ResultsNotReceived, match="no listing of node 1's results"):
        R.receive_results(other, mine, node=1, timeout_s=5)
    tampered = HashStore()
    R.publish_results(tampered, theirs, node=1)
    tampered.set(R.FILE_KEY + METRICS_FILE + "#0", b"{}\n" * 100)
    with pytest.raises(R.ResultsNotReceived, match="metrics.jsonl arrived with another size or hash than node 1 listed"):
        R.receive_results(tampered, mine, node=1, timeout_s=5)
    assert not (mine / SUMMARY_FILE).exists() and not (mine / METRICS_FILE).exists()  # nothing half-taken
    lied = HashStore()
    R.publish_results(lied, theirs, node=1)
    listing = json.loads(lied.get(R.LISTING_KEY))
    listing["files"][TRACE_FILE]["bytes"] = R.MAX_RESULT_BYTES + 1
    lied.set(R.LISTING_KEY, json.dumps(listing))
    with pytest.raises(R.ResultsNotReceived, match=rf"node 1 listed trace.json at {R.MAX_RESULT_BYTES + 1} bytes"):
        R.receive_results(lied, mine, node=1, timeout_s=5)
    summary_bytes = len((theirs / SUMMARY_FILE).read_bytes())
    assert len((theirs / METRICS_FILE).read_bytes()) > summary_bytes
    monkeypatch.setattr(R, "MAX_RESULT_BYTES", summary_bytes)  # the metrics stay on node 1, the rest comes
    big = HashStore()
    assert R.publish_results(big, theirs, node=1) == [METRICS_FILE]
    assert R.receive_results(big, mine, node=1, timeout_s=5) == [METRICS_FILE]
    assert (mine / SUMMARY_FILE).read_bytes() == (theirs / SUMMARY_FILE).read_bytes() and not (mine / METRICS_FILE).exists()
    monkeypatch.setattr(R, "MAX_RESULT_BYTES", 10)  # the summary too: none are taken
    huge = HashStore()
    R.publish_results(huge, theirs, node=1)
    with pytest.raises(R.ResultsNotReceived, match=r"node 1 sent no summary.json \(\d+ bytes, over 10\)"):
        R.receive_results(huge, tmp_path / "empty", node=1, timeout_s=5)


def test_files_over_the_stores_value_cap_go_in_pieces() -> None:
    """torch's TCPStore resets a client that sets a value over 8 MiB: a 9 MiB file (a stage's
    weights, a long trace) goes through node 0's real store in pieces, and comes back whole."""
    from pdcli import share
    from pdcli.runtime.rendezvous import listen_store

    store = listen_store("127.0.0.1", 0, 30.0, "")
    data = bytes(range(256)) * (9 * 4096 + 1)
    share.put_bytes(store, "file/stages/stage0.pt", data)
    assert share.get_bytes(store, "file/stages/stage0.pt", len(data)) == data
    share.put_bytes(store, "empty", b"")
    assert share.get_bytes(store, "empty", 0) == b""
    with pytest.raises(ValueError, match="were listed"):  # a listing that lies about the size
        share.get_bytes(store, "file/stages/stage0.pt", len(data) - 1)
