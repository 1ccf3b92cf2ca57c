"""The small interface every cloud implements, and the records it hands back.

Shaped after provisioning APIs that proved themselves (SkyPilot's `sky/provision`,
dstack's `Compute`): the cloud's tags are the source of truth, `create` is idempotent
(it counts what already carries the cluster's tag and starts only the rest) and
`terminate` treats an instance that is already gone as done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from dtrain.errors import DtrainError

TAG_CLUSTER = "dtrain:cluster"
TAG_TOKEN = "dtrain:token"
# States in which an instance still costs money or may start to.
ALIVE = ("pending", "running", "stopping", "stopped", "shutting-down")


@dataclass(frozen=True)
class Instance:
    id: str
    cluster: str
    name: str
    state: str
    zone: str
    instance_type: str
    private_ip: str | None
    public_ip: str | None
    launched_at: float  # epoch seconds, as the cloud reports it
    spot: bool

    @property
    def alive(self) -> bool:
        return self.state in ALIVE


@dataclass(frozen=True)
class ZoneFailure:
    zone: str
    code: str
    message: str

    def line(self) -> str:
        return f"{self.zone}: {self.code} ({self.message})"


class ProviderError(DtrainError):
    """The cloud refused a request that waiting or another zone cannot fix."""


class CapacityError(ProviderError):
    """Every zone was tried and none could start the instances."""

    def __init__(self, what: str, failures: list[ZoneFailure]) -> None:
        super().__init__(
            f"no zone could start {what}: " + "; ".join(f.line() for f in failures),
            "add zones, pick another instance type or region, or ask for a higher quota",
        )
        self.failures = failures


class Provider(ABC):
    """One cloud account in one region, configured by the cluster file's `cloud:` section."""

    @abstractmethod
    def create(self, cluster: str, token: str, count: int) -> list[Instance]:
        """Ensure `count` live instances tagged `cluster`; start only the missing ones."""

    @abstractmethod
    def wait(self, cluster: str, count: int, timeout: float) -> list[Instance]:
        """Until `count` instances of `cluster` run and have addresses (bounded)."""

    @abstractmethod
    def query(self, cluster: str | None = None) -> list[Instance]:
        """The cloud's view: every instance tagged `cluster` (any dtrain cluster if None)."""

    @abstractmethod
    def terminate(self, ids: list[str], timeout: float) -> None:
        """Terminate and confirm each is gone; an instance already gone is not an error."""

    @abstractmethod
    def address(self, instance: Instance) -> str:
        """The address the head and the other nodes reach `instance` at."""

    @abstractmethod
    def node_access(self, instance: Instance) -> dict:
        """What `instance` needs to terminate itself (autostop): JSON-able, with "provider"
        and "instance_id"; it may hold credentials, so it only travels on stdin into a
        0600 file on the node."""

    @abstractmethod
    def price(self, instance: Instance) -> float | None:
        """This instance's price per hour in USD, None if unknown."""
