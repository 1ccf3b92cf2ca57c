"""Clients that connect and then send nothing, or a request a few bytes at a time (slowloris).

Each such connection holds a socket and a file descriptor for as long as its client likes:
uvicorn times out only an idle connection between two requests (timeout_keep_alive), not
one whose request head never ends, and not an upload that stalls. A thousand of them (the
common `ulimit -n` of 1024) left `dtrain serve` answering nobody, /healthz included
("Too many open files"). So:
- a request head must arrive within `client_timeout_s` of the connection (or of the first
  byte of the next request on a kept-alive one), else the connection is closed
  (`head_deadline_protocol`);
- an upload that sends nothing for `client_timeout_s` gets a 408 (app.BodyLimit);
- the soft limit on open files is raised to the hard one (`raise_open_file_limit`), so the
  clients' share of descriptors is what the system allows, not a login shell's default.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def head_deadline_protocol(client_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (the one it picks without httptools) with a deadline on each request head."""

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _watch_head(self) -> None:
            """Armed while the client owes a request head; the keep-alive timer covers a
            connection that is silent between requests, and ends when bytes come."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self._stop_head_timer()
            elif self._head_timer is None:
                self._head_timer = self.loop.call_later(client_timeout_s, self._head_too_slow)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard one (2**20 where the hard one is unlimited)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a container may refuse even its own hard limit: keep the soft one
            pass
