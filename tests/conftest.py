"""Shared test fixtures: the shared PipeDream profiles and a scratch config tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import os

import pytest

# The pipeline probe (a real 2-worker run inside every `pd profile`) is off in the tests that
# profile for another purpose; tests of the probe itself turn it back on.
os.environ.setdefault("PD_PIPELINE_PROBE", "0")
# The probes' time floors (`profile.probe_seconds`) too: their minimum minibatch counts measure enough
# for what these tests check.
os.environ.setdefault("PD_PROBE_SECONDS", "0")
# The host calibration file (`pdcli.probe.hostfile`) of the tests: one per session, measured by
# the first profile that needs it, never the user's ~/.cache/pd.
if "PD_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["PD_CACHE_DIR"] = tempfile.mkdtemp(prefix="pd-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PD_CACHE_DIR"], True)

SESSION_CACHE = Path(os.environ["PD_CACHE_DIR"])

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROFILES = SHARED / "pipedream-profiles"


@pytest.fixture(autouse=True)
def _own_profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own cache of profiles (`pdcli.probe.profile_cache`: what one test measured,
    or made up, is no other test's profile), the session's host file shared."""
    from pdcli.probe.profile_cache import without_profiles

    own = tmp_path_factory.mktemp("cache")
    without_profiles(own, SESSION_CACHE)
    monkeypatch.setenv("PD_CACHE_DIR", str(own))


@pytest.fixture
def shared_profiles() -> Path:
    if not (PROFILES / "expected.json").exists():
        pytest.skip("../shared/pipedream-profiles is not beside the repo")
    return PROFILES


@pytest.fixture
def deep_profile() -> Any:
    """benchmarks/deep_profile.py, the planner benchmark's deep graph generator (`deep_graph()`)."""
    import importlib.util

    path = REPO / "benchmarks" / "deep_profile.py"
    spec = importlib.util.spec_from_file_location("deep_profile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
