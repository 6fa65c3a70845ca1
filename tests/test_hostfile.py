"""The host calibration file: measured once per host key, reused by later profiles, measured
again when the key, the schema or the age says so (`pdcli.probe.hostfile`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcli.planner.runtime_costs import Affine
from pdcli.probe import hostfile
from pdcli.probe.hostfile import HOST_META, HOST_SCHEMA, HostFile, cache_root, host_key

KEY = {"schema": HOST_SCHEMA, "hostname": "h", "machine": "x86_64", "cpu": "cpu", "cores": 2, "gpu": None,
       "torch": "2.13.0", "python": "3.11.7"}


class Counting:
    """A stand-in transport measurement that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> tuple[float, float, Affine]:
        self.calls += 1
        return (0.1 * self.calls, 1e9, Affine(1e-8, 0.02))


def test_a_second_profile_on_the_same_host_reuses_the_file(tmp_path: Path) -> None:
    measure = Counting()
    first = HostFile(tmp_path, KEY)
    assert first.transport(measure) == (0.1, 1e9, Affine(1e-8, 0.02))
    assert first.measured == ["transport"] and "no calibration" in first.why
    second = HostFile(tmp_path, KEY)
    assert second.transport(measure) == (0.1, 1e9, Affine(1e-8, 0.02))
    assert measure.calls == 1
    record = second.record()
    assert record["reused"] == ["transport"] and record["measured"] == []
    assert record["file"] == str(first.path) and record["sha256"] == first.sha256()


def test_a_changed_key_measures_again_and_says_what_changed(tmp_path: Path) -> None:
    measure = Counting()
    HostFile(tmp_path, KEY).transport(measure)
    upgraded = HostFile(tmp_path, {**KEY, "torch": "2.14.0"})
    assert upgraded.path != HostFile(tmp_path, KEY).path
    assert upgraded.transport(measure)[0] == pytest.approx(0.2)
    assert measure.calls == 2
    assert "torch 2.13.0 -> 2.14.0" in upgraded.why


def test_an_older_schema_or_age_measures_again(tmp_path: Path) -> None:
    measure = Counting()
    made = HostFile(tmp_path, KEY, now_s=1000.0)
    made.transport(measure)
    assert made.path is not None
    stale_days = HostFile(tmp_path, KEY, max_age_days=30, now_s=1000.0 + 31 * hostfile.DAY_S)
    assert "31 days old" in stale_days.why and stale_days.figures == {}
    assert HostFile(tmp_path, KEY, max_age_days=0, now_s=1000.0 + 400 * hostfile.DAY_S).figures  # 0: never by age
    obj = json.loads(made.path.read_text())
    obj["key"]["schema"] = HOST_SCHEMA - 1
    made.path.write_text(json.dumps(obj))
    older = HostFile(tmp_path, KEY, now_s=1000.0)
    assert "schema" in older.why and older.figures == {}
    older.transport(measure)
    assert measure.calls == 2
    assert json.loads(made.path.read_text())["key"]["schema"] == HOST_SCHEMA


def test_recalibrate_and_off(tmp_path: Path) -> None:
    measure = Counting()
    HostFile(tmp_path, KEY).transport(measure)
    again = HostFile(tmp_path, KEY, recalibrate=True)
    again.transport(measure)
    assert measure.calls == 2 and "--recalibrate" in again.why
    off = HostFile(cache_root("off"), KEY)
    off.transport(measure)
    off.transport(measure)
    assert measure.calls == 3 and off.path is None and off.record()["file"] is None


def test_figures_added_to_a_fresh_file_keep_its_age(tmp_path: Path) -> None:
    HostFile(tmp_path, KEY, now_s=1000.0).transport(Counting())
    later = HostFile(tmp_path, KEY, now_s=5000.0)
    later.allreduce(2, lambda threads: (Affine(1e-6, 3.0), [[65536.0, 3.1]]))
    assert later.path is not None
    obj = json.loads(later.path.read_text())
    assert obj["measured_at_s"] == 1000.0 and set(obj["figures"]) == {"transport", "allreduce_threads_2"}


def test_cache_root_follows_the_setting_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root("") == tmp_path / "env"
    assert cache_root(str(tmp_path / "set")) == tmp_path / "set"
    monkeypatch.delenv("PD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("") == tmp_path / "xdg" / "pd"
    from pdcli.config.loader import load_config

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    setting = load_config(recipe, ["profile.host_cache=off"]).config.profile.host_cache  # YAML's false
    assert cache_root(setting) is None, setting
    key = host_key("cpu")
    assert key["schema"] == HOST_SCHEMA and key["cores"] >= 1 and key["torch"]


@pytest.mark.slow  # two profiles with the runtime probe, ~7 s
def test_profiles_of_two_recipes_share_the_host_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second profile (another run directory, another model size) reads the transport from
    the file the first wrote: nothing of the host is measured, and its figures are copied in."""
    from pdcli.config.loader import load_config
    from pdcli.probe import runtime as probe_runtime
    from pdcli.rundir import RunDir
    from pdcli.steps.profile import ensure_profile

    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "cache"))
    repo = Path(__file__).resolve().parents[1]

    def profile(name: str, *extra: str) -> dict:
        cfg = load_config(repo / "recipes" / "quickstart.yaml",
                          [f"run.root={tmp_path}", f"run.name={name}", "train.steps=2", *extra]).config
        chain, reused = ensure_profile(cfg, RunDir(tmp_path / name).create())
        assert not reused
        return chain.meta

    first = profile("a")
    assert first[HOST_META]["measured"] == ["transport"]

    def no_measuring() -> None:
        raise AssertionError("the host was measured again")

    monkeypatch.setattr(probe_runtime, "measure_socket_transport", no_measuring)
    second = profile("b", "model.kwargs.hidden=64")
    assert second[HOST_META]["reused"] == ["transport"] and second[HOST_META]["measured"] == []
    assert second[HOST_META]["sha256"] == first[HOST_META]["sha256"]
    assert second["runtime"]["latency_ms"] == first["runtime"]["latency_ms"]
