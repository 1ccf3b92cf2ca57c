"""The root cause of a failed job, from what each node printed and how it ended.

When one rank dies, its peers on other nodes fail a moment later with communication
errors ("Connection closed by peer") and their torchrun agents exit too, sometimes
before the first one's agent noticed. So the first node to exit is not always the
culprit: a node whose failing rank shows a peer-communication error is only a root
cause when no other node failed on its own. And that echo can be reported first: the
head then stops the other nodes, the culprit among them; a node we were stopping whose
torchrun still reports a rank that died of something else than our SIGTERM and than a
peer's death failed on its own before the stop reached it. When every failed node shows
only echoes (a rank killed by a signal prints nothing, and its node's other ranks then
lose it too), the echoes themselves point at the culprit: gloo names the peer it lost by
address ("Connection closed by peer [10.0.0.2]:44695"), and where the caller knows the
nodes' addresses, the one node they all name is the root cause.
"""

from __future__ import annotations

import re
import signal
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

# torchrun's failure report: "rank      : 3 (local_rank: 1)" / "exitcode  : -9 (pid: 123)"
_ROOT = re.compile(r"^\s*Root Cause \(first observed failure\)")
_RANK = re.compile(r"^\s*rank\s*:\s*(-?\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_PEER_ERROR = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"remote process exited|DistNetworkError|DistStoreError|NCCL communicator was aborted|"
    r"Socket Timeout|RendezvousClosedError|RendezvousConnectionError|Signal 15 \(SIGTERM\) received",
    re.IGNORECASE,
)
# the peer gloo lost, as it names it: "... by peer [10.0.0.2]:44695", "Read error [10.0.0.2]:37582"
_PEER_ADDRESS = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]:\d+")
# a worker's line as torchrun prints it with dtrain's --log-line-prefix-template: "[h2:r3] text"
PREFIXED = re.compile(r"^\[(?P<node>[^\]:]+):r(?P<rank>\d+)\] ?(?P<text>.*)$", re.DOTALL)
TAIL = 12


@dataclass
class NodeEnd:
    """How one node's part of the job ended, as seen from the head."""

    name: str
    exit_code: int | None = None
    ended_at: float | None = None
    stopped_by_us: bool = False  # we had asked it to stop before it ended
    connection_lost: bool = False  # ssh ended without the wrapper's exit report
    agent_lines: deque = field(default_factory=lambda: deque(maxlen=200))
    rank_lines: dict[int, deque] = field(default_factory=dict)

    def add(self, rank: int | None, text: str) -> None:
        if rank is None:
            self.agent_lines.append(text)
        else:
            self.rank_lines.setdefault(rank, deque(maxlen=200)).append(text)

    def failed_rank(self) -> tuple[int | None, int | None]:
        """(rank, exitcode) from torchrun's "Root Cause" block, if it printed one."""
        lines = list(self.agent_lines)
        for i, line in enumerate(lines):
            if _ROOT.match(line):
                rank = code = None
                for follow in lines[i + 1 : i + 12]:
                    if rank is None and (m := _RANK.match(follow)):
                        rank = int(m.group(1))
                    if code is None and (m := _EXIT.match(follow)):
                        code = int(m.group(1))
                return rank, code
        return None, None

    def tail(self, rank: int | None) -> list[str]:
        lines = list(self.rank_lines.get(rank, ())) if rank is not None else []
        if not lines:
            lines = [ln for ln in self.agent_lines if ln.strip()]
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("Traceback")]
        if starts:
            lines = lines[starts[-1]:]
        return lines[-TAIL:]

    def peers_named(self) -> list[str]:
        """The addresses this node's ranks' peer errors name (one per mention)."""
        return [m.group(1) for lines in self.rank_lines.values() for ln in list(lines)[-TAIL:]
                if _PEER_ERROR.search(ln) for m in _PEER_ADDRESS.finditer(ln)]

    def peer_error(self) -> bool:
        rank, _ = self.failed_rank()
        said = any(_PEER_ERROR.search(ln) for ln in self.tail(rank))
        if rank is not None or said:
            return said
        # The failing rank is unknown (under srun the agents' reports are not told apart by
        # node): an echo when every rank of this node that raised shows a peer error. A rank
        # killed by a signal prints no traceback, so its node is never taken for an echo.
        raised = [r for r, lines in self.rank_lines.items() if any("Traceback (most recent call last)" in ln for ln in lines)]
        return bool(raised) and all(any(_PEER_ERROR.search(ln) for ln in self.tail(r)) for r in raised)


@dataclass
class RootCause:
    node: str
    rank: int | None
    exit_code: int | None
    rank_exit_code: int | None
    tail: list[str]
    connection_lost: bool

    def describe(self) -> str:
        who = f"node {self.node}" + (f" rank {self.rank}" if self.rank is not None else "")
        if self.connection_lost:
            # A local node has no ssh: its wrapper process itself ended without its exit report.
            code = self.exit_code
            killed = _signal_name(128 - code) if code is not None and 128 < code < 160 else ""
            head = f"first failure: {who}: lost the connection to the node (its ssh or node wrapper ended without a word: exit {code}{killed})"
        else:
            code = self.rank_exit_code if self.rank_exit_code is not None else self.exit_code
            head = f"first failure: {who} exited with code {code}{_signal_name(code)}"
        body = [f"  | {ln}" for ln in self.tail]
        return "\n".join([head, *(["  last lines:"] + body if body else [])])


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


# {node: address}, or a function that looks the addresses up (one scontrol call per node).
Addresses = dict[str, str] | Callable[[], dict[str, str]]


def root_cause(ends: list[NodeEnd], addresses: Addresses | None = None) -> RootCause | None:
    """`addresses`: {node: the address its ranks talk from}, to follow echoes to the node they
    name; or a function that looks them up, called only when every failed node echoes."""
    failed = [e for e in ends if e.exit_code not in (0, None) and not e.stopped_by_us]
    if not failed:
        return None
    if all(_echo(e) for e in failed):  # the culprit may be among the nodes we went on to stop
        failed += [e for e in ends if e.stopped_by_us and e.exit_code not in (0, None) and _failed_on_its_own(e)]
    # Lost connections and own failures before peer-error echoes; then by time.
    first = min(failed, key=lambda e: (_echo(e), e.ended_at or 0.0))
    if _echo(first) and addresses:
        table = addresses() if callable(addresses) else addresses
        first = _named_by_echoes(failed, table) or first
    rank, rank_code = first.failed_rank()
    return RootCause(first.name, rank, first.exit_code, rank_code, first.tail(rank), first.connection_lost)


def _named_by_echoes(failed: list[NodeEnd], addresses: dict[str, str]) -> NodeEnd | None:
    """The one failed node whose address every echo that names one names (its ranks lost a
    peer there, as did the others'), else None."""
    node_at = {addr: node for node, addr in addresses.items()}
    named = Counter(node_at.get(a) for e in failed for a in e.peers_named())
    if len(named) != 1 or None in named:  # none, several, or an address of no node: srun's order stands
        return None
    culprit = next(iter(named))
    return next((e for e in failed if e.name == culprit), None)


def _echo(e: NodeEnd) -> bool:
    return not e.connection_lost and e.peer_error()


def _failed_on_its_own(e: NodeEnd) -> bool:
    """A node we stopped whose torchrun had seen a rank die first, of neither our stop
    (we only ever send SIGTERM) nor a peer's death."""
    _, code = e.failed_rank()
    return code is not None and code != -signal.SIGTERM and not e.peer_error()
