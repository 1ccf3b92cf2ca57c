"""Typed configs validated at the edge: YAML files plus `--set key=value` overrides.

Every config in dtrain is a pydantic model derived from `StrictModel` (unknown keys are
rejected). `load_config` is the one place that reads such a model from YAML, applies
dotted overrides and turns validation errors into a `ConfigError` that names the key,
the source and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from dtrain.errors import ConfigError


class StrictModel(BaseModel):
    """Base for every dtrain config: unknown keys are errors, assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


M = TypeVar("M", bound=BaseModel)


def load_config(
    model: type[M],
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> M:
    """Build `model` from `base` <- YAML file at `path` <- `overrides` ("a.b=value")."""
    data: dict[str, Any] = dict(base or {})
    source = "defaults"
    if path is not None:
        data = _deep_merge(data, read_mapping(path))
        source = str(path)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return validate(model, data, source)


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in the file at `path` (a missing file, bad YAML or a non-mapping
    is a ConfigError)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", "check the path, or omit it to use the defaults")
    # Bytes, not the locale's text: YAML is UTF-8 (or UTF-16 with its mark) whatever LANG says,
    # and PyYAML's reader then reports a byte that is not (a Windows editor's Latin-1 é) with its place.
    raw = path.read_bytes()
    try:
        loaded = yaml.safe_load(raw) or {}
    except yaml.reader.ReaderError as exc:
        line = raw[: exc.position].count(b"\n") + 1
        raise ConfigError(f"{path} is not YAML text at line {line} ({exc.reason}: #x{exc.character:02x})",
                          "YAML files are UTF-8 text: save it as UTF-8 (your editor's encoding setting, "
                          "or `iconv -f latin1 -t utf-8`), without control characters") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML recurses per nesting level: "[[[...]]]" a thousand deep
        raise ConfigError(f"{path} is not valid YAML: nested too deeply to read") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(loaded).__name__}")
    return loaded


def validate(model: type[M], data: dict[str, Any], source: str = "config") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(model, exc, source)) from None


def parse_override(item: str) -> tuple[str, Any]:
    """`"optim.lr=3e-4"` -> `("optim.lr", 0.0003)`; values are read as YAML scalars."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad override {item!r}", "write it as key=value, e.g. --set optim.lr=0.001")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(model: type[BaseModel], exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        dotted = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            valid = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            prefix = ".".join(loc[:-1])
            msg = f"unknown key '{dotted}' in {source}"
            if close:
                msg += f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
            else:
                msg += f"; valid keys here: {', '.join(sorted(valid))}"
            lines.append(msg)
        else:
            got = err.get("input")
            lines.append(f"{dotted}: {err['msg']} (got {got!r}) in {source}")
    return "\n".join(lines)


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the (nested) model found by following `loc` from `model`."""
    current: Any = model
    for part in loc:
        if part.isdigit():  # an item of a list of models: the item's model is already current
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _model_of(field.annotation)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None
