"""Whether `kvserve serve` can listen where it was asked, found before the model loads: a port
in use or a host this machine does not have was uvicorn's "address already in use" (exit 3)
once the engine had started, tens of seconds to minutes later. vLLM binds its socket first too."""

from __future__ import annotations

import errno
import socket


def listen_error(host: str, port: int) -> str | None:
    """A line naming the flag, or None when every address `host` resolves to can be bound, as
    asyncio's create_server binds them (SO_REUSEADDR, IPv6 sockets IPv6-only)."""
    if port == 0:  # the system picks a free one
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"host: cannot listen on {host!r}: {e.strerror}"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                flag = "port" if e.errno == errno.EADDRINUSE else "host"
                return f"{flag}: cannot listen on {host}:{port}: {e.strerror}"
    return None
