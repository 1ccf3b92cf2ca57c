"""Optional dependency groups (pyproject.toml's extras) and the one-line hint when one is missing.

A GPU node needs the trainer and the monitor agent, not the web stack: `pip install dtrain`
gives `dtrain run`, `dtrain train`, the agent, `top` and `report`; the rest are extras
that the commands needing them check for before they start:

    serve      dtrain export / inspect / serve   (ONNX, ONNX Runtime, FastAPI, uvicorn)
    s3         s3:// data addresses               (s3fs)
    dashboard  dtrain dashboard                   (plotly, whose wheel ships plotly.min.js)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from dtrain.errors import DtrainError

# extra -> the top-level modules it installs (import names, not distribution names)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "python_multipart", "onnx", "onnxruntime", "onnxscript"),
    "s3": ("s3fs",),
    "dashboard": ("plotly",),
}


def missing(modules: Sequence[str]) -> list[str]:
    """The modules that cannot be imported here (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """Raise a DtrainError naming `extra` when any of its `modules` (default: all) is missing."""
    absent = missing(EXTRAS[extra] if modules is None else modules)
    if absent:
        raise DtrainError(f"{what} needs the '{extra}' extra ({', '.join(absent)} not installed): "
                          f"pip install 'dtrain[{extra}]'")  # fmt: skip
