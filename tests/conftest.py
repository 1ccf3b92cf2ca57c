"""Shared fixtures. Tests run real processes (gloo on CPU); nothing here mocks torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The multi-host harness: the session fixture `netns_cluster` (owner: cluster).
pytest_plugins = ["tests.netns"]


@pytest.fixture
def dtrain_home(tmp_path, monkeypatch) -> Path:
    """An isolated $DTRAIN_HOME so tests never touch ~/.dtrain."""
    home = tmp_path / "dtrain-home"
    home.mkdir()
    monkeypatch.setenv("DTRAIN_HOME", str(home))
    return home


@pytest.fixture
def dtrain_cmd() -> list[str]:
    """The dtrain CLI as a subprocess argv, using this interpreter."""
    return [sys.executable, "-m", "dtrain"]


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory) -> Path:
    """A small synthetic defect data set (owner: data): 32 px, 360 images, seed 0,
    ImageFolder layout ROOT/{train,val,test}/<class>/*.png + manifest.json. Read-only:
    copy it before changing files in it."""
    from dtrain.data.synth import synthesize

    root = tmp_path_factory.mktemp("synth_data")
    synthesize(root, images=360, size=32, seed=0, workers=1)
    return root


def pytest_report_header(config):
    return f"dtrain tests: uid={os.getuid()} cpus={os.cpu_count()}"
