"""Shared test fixtures: the shared PipeDream profiles and a scratch config tree."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROFILES = SHARED / "pipedream-profiles"


@pytest.fixture
def shared_profiles() -> Path:
    if not (PROFILES / "expected.json").exists():
        pytest.skip("../shared/pipedream-profiles is not beside the repo")
    return PROFILES
