"""Secret environment values: they reach the ranks, never a file under $DTRAIN_HOME.

A job environment value is secret when its name was marked (`--secret-env NAME`,
job.yaml `secret_env:`) or looks like a credential (`looks_secret`). The job file keeps
a placeholder in its place; the values stay in the memory of the process that launched
the job and reach a detached supervisor through a pipe (its stdin), never a file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from dtrain.errors import ConfigError

# A name holding one of these words (any case, anywhere: HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# DB_PASSWORD, WANDB_API_KEY, GOOGLE_APPLICATION_CREDENTIALS, BASIC_AUTH) is secret.
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "KEY", "CREDENTIAL", "AUTH",
                "COOKIE", "PRIVATE", "SIGNATURE")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDER = re.compile(r"^<secret \d+>$")
# Shorter values are not masked in printed text (they would blank out unrelated words);
# they are still kept out of every file.
_MIN_MASKED = 3


# Set in every rank's environment when names are marked: the list of them (no values),
# so that the ssh runner also keeps those values off the remote command line.
MARKED_ENV = "DTRAIN_MASKED_ENV"


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def secret_names(env: Mapping[str, str]) -> list[str]:
    """The names in `env` whose values are secret: marked (MARKED_ENV) or looking it."""
    marked = set(filter(None, env.get(MARKED_ENV, "").split(",")))
    return [name for name in env if name in marked or looks_secret(name)]


def resolve(names: Iterable[str], env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The values of the marked names: from `env` when given there, else from the head's
    environment (`environ`), so that they never appear on a command line."""
    out = {}
    for name in names:
        if not ENV_NAME.match(name):
            raise ConfigError(f"bad secret name {name!r}",
                              "write --secret-env NAME; its value comes from your shell (export NAME=...)")
        if name in env:
            out[name] = env[name]
        elif name in environ:
            out[name] = environ[name]
        else:
            raise ConfigError(f"secret {name} is not set in this shell",
                              f"export {name}=... first (its value is read from the environment of `dtrain run`)")
    return out


def split(payload: Any, marked: Iterable[str] = ()) -> tuple[Any, dict[str, str]]:
    """(`payload` with every secret value of an `env` map replaced by a placeholder, the
    values by placeholder). `payload` is plain JSON data (job file contents)."""
    marked = set(marked)
    values: dict[str, str] = {}
    by_value: dict[str, str] = {}

    def hide(name: str, value: Any) -> Any:
        if not isinstance(value, str) or not (name in marked or looks_secret(name)):
            return value
        if value not in by_value:
            by_value[value] = f"<secret {len(by_value)}>"
            values[by_value[value]] = value
        return by_value[value]

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ({n: hide(n, v) for n, v in node[k].items()} if k == "env" and isinstance(node[k], dict)
                        else walk(node[k])) for k in node}
        if isinstance(node, list):
            return [walk(x) for x in node]
        return node

    return walk(payload), values


def join(payload: Any, values: Mapping[str, str]) -> Any:
    """The inverse of `split`: placeholders back to their values."""
    if isinstance(payload, dict):
        return {k: join(v, values) for k, v in payload.items()}
    if isinstance(payload, list):
        return [join(x, values) for x in payload]
    if isinstance(payload, str) and _PLACEHOLDER.match(payload):
        if payload not in values:
            raise ConfigError("the job file names secret values this process was not given",
                              "a detached supervisor gets them from `dtrain run` on its stdin; start the job again")
        return values[payload]
    return payload


def mask(text: str, values: Iterable[str]) -> str:
    """`text` (a dry-run listing, a log line) with every secret value shown as <secret>."""
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= _MIN_MASKED:
            text = text.replace(value, "<secret>")
    return text


def send(values: Mapping[str, str], pipe: TextIO) -> None:
    """Hand the values to a detached supervisor (`receive` reads them)."""
    with pipe:
        pipe.write(json.dumps(dict(values)))


def receive(pipe: TextIO) -> dict[str, str]:
    text = pipe.read()
    return json.loads(text) if text.strip() else {}
