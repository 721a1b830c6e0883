"""The listening socket of loom's HTTP servers (``loom serve``, ``loom router``)."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, not inherited by child
    processes; a port in use (or a bad host) is a ValueError naming the flags to change.

    The protocol must say TCP: asyncio sets TCP_NODELAY only on sockets that do, and
    without it every response waits ~40 ms for a delayed ACK (Nagle)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}; pick another "
                         "--port or --host") from None
    listener.listen(2048)
    listener.set_inheritable(False)
    return listener
