"""This host's profiles, reused across run directories for the same inputs
(`pdcli.probe.profile_cache`, `pdcli.steps.profile.ensure_profile`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcli.probe import hostfile
from pdcli.probe.hostfile import cache_root
from pdcli.probe.profile_cache import ProfileCache

KEY = {"schema": hostfile.HOST_SCHEMA, "hostname": "h", "machine": "x86_64", "cpu": "cpu", "cores": 2, "gpu": None,
       "torch": "2.13.0", "python": "3.11.7"}
REPO = Path(__file__).resolve().parents[1]


def test_a_profile_is_found_for_its_inputs_on_its_host_only(tmp_path: Path) -> None:
    ProfileCache(tmp_path, KEY, now_s=1000.0).put("abc", {"nodes": []})
    got = ProfileCache(tmp_path, KEY, now_s=1000.0 + 3600.0).get("abc")
    assert got is not None and got[0] == {"nodes": []} and got[2] == pytest.approx(1 / 24)
    assert ProfileCache(tmp_path, KEY).get("abd") is None  # other inputs
    assert ProfileCache(tmp_path, {**KEY, "torch": "2.14.0"}).get("abc") is None  # another host key
    assert ProfileCache(tmp_path, KEY, max_age_days=30, now_s=1000.0 + 31 * hostfile.DAY_S).get("abc") is None
    assert ProfileCache(tmp_path, KEY, max_age_days=0, now_s=1000.0 + 400 * hostfile.DAY_S).get("abc") is not None
    off = ProfileCache(cache_root("off"), KEY)
    off.put("abc", {"nodes": []})
    assert off.get("abc") is None and off.dir is None


def test_an_unreadable_or_moved_entry_is_not_used(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path, KEY)
    cache.put("abc", {"nodes": []})
    path = cache.path("abc")
    assert path is not None
    path.write_text(path.read_text()[:20])
    assert cache.get("abc") is None
    cache.put("abc", {"nodes": []})
    path.rename(path.with_name("abd.json"))  # an entry under another inputs hash than it records
    assert cache.get("abd") is None


def test_a_second_run_directory_copies_the_profile_and_force_measures_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second run directory of the same recipe gets the first's profile (nothing measured:
    the profiler is not called), written as its own artifact; another model size, or --force,
    measures."""
    from pdcli.config.loader import load_config
    from pdcli.profiler.chain import PROFILE_ARTIFACT
    from pdcli.rundir import RunDir
    from pdcli.steps import profile as step

    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "cache"))

    def profile(name: str, *extra: str, force: bool = False) -> tuple[dict, bool, RunDir]:
        cfg = load_config(REPO / "recipes" / "quickstart.yaml",
                          [f"run.root={tmp_path}", f"run.name={name}", "profile.runtime_probe=false", *extra]).config
        run = RunDir(tmp_path / name).create()
        chain, reused = step.ensure_profile(cfg, run, force=force)
        return chain.to_json(), reused, run

    first, reused, _ = profile("a")
    assert not reused
    measured = step.profile_config

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured although this host has the profile")

    monkeypatch.setattr(step, "profile_config", no_measuring)
    second, reused, run = profile("b")
    assert reused and second == first
    assert json.loads((run.path / PROFILE_ARTIFACT).read_text()) == first
    assert run.fresh(PROFILE_ARTIFACT, json.loads((run.path / "manifest.json").read_text())["artifacts"][PROFILE_ARTIFACT]["inputs_hash"])
    with pytest.raises(AssertionError, match="measured although"):
        profile("c", "model.kwargs.hidden=64")
    with pytest.raises(AssertionError, match="measured although"):
        profile("b", force=True)
    monkeypatch.setattr(step, "profile_config", measured)
    _, reused, _ = profile("d", "profile.host_cache=off")
    assert not reused
