"""Where rented nodes come from: a registry of providers by name, imported lazily.

A provider's SDK (boto3 for EC2) is imported only when that provider is used, so
`dtrain --help` and SSH-only clusters never pay for it.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.cluster.providers.base import Provider
    from dtrain.cluster.providers.config import CloudSpec

# name -> "module:class"
_PROVIDERS = {
    "ec2": "dtrain.cluster.providers.ec2:Ec2Provider",
}


def provider_names() -> list[str]:
    return sorted(_PROVIDERS)


def check_provider_name(name: str) -> str:
    if name not in _PROVIDERS:
        close = difflib.get_close_matches(name, _PROVIDERS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"the providers are: {', '.join(provider_names())}"
        raise ConfigError(f"unknown cloud provider {name!r}", hint)
    return name


def make_provider(spec: CloudSpec, **deps: Any) -> Provider:
    """The provider `spec.provider` names, configured by `spec`; `deps` are its side
    effects (client, sleep, clock, echo) for tests to stand in for."""
    module, cls = _PROVIDERS[check_provider_name(spec.provider)].split(":")
    return getattr(importlib.import_module(module), cls)(spec, **deps)
