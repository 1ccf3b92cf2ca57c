"""The listening socket of `dtrain serve`.

Bound by dtrain (not uvicorn) so that "serving on" is printed only for a socket that
listens. socket.create_server makes it with protocol number 0, and asyncio sets
TCP_NODELAY only on accepted sockets whose protocol reads IPPROTO_TCP, so without the
option set here Nagle's algorithm stayed on: uvicorn writes a response's head and body
separately, the body waited for the client's delayed ACK, and every request after the
first on a keep-alive connection took 40 ms more (bench/serve_load.py). Linux copies
TCP_NODELAY from a listening socket to the connections it accepts.
"""

from __future__ import annotations

import socket


def listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
