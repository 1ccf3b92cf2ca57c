"""The torch-free install of an inspection PC: pyproject's `runtime` extra holds what the
runtime imports and nothing heavy, and `python -m dtrain.requirements` lists it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from dtrain.requirements import extra_requirements

REPO = Path(__file__).resolve().parents[1]


def _metadata_from_pyproject(dist: str) -> list[str]:
    """Requires-Dist lines as pip writes them from pyproject.toml (the installed metadata may predate it)."""
    assert dist == "dtrain"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        lines += [f'{r}; extra == "{extra}"' for r in reqs]
    return lines


def _names(reqs: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs}


def test_the_runtime_extra_has_onnxruntime_and_the_web_stack_and_no_torch():
    names = _names(extra_requirements("runtime", _metadata_from_pyproject))
    assert {"onnxruntime", "fastapi", "uvicorn", "python-multipart", "pillow", "numpy", "pydantic"} <= names
    assert not names & {"torch", "torchvision", "scipy"}


def test_serve_expands_to_runtime_plus_the_export_packages():
    serve = extra_requirements("serve", _metadata_from_pyproject)
    assert set(extra_requirements("runtime", _metadata_from_pyproject)) < set(serve)
    assert {"onnx", "onnxscript"} <= _names(serve)
    assert not any(r.startswith("dtrain") for r in serve)


def test_an_unknown_extra_is_a_usage_error(capsys):
    from dtrain.requirements import main

    assert main(["no-such-extra"]) == 1
    assert "no extra 'no-such-extra'" in capsys.readouterr().err
