"""ZeroMQ endpoints of every socket the service binds or connects."""

from __future__ import annotations

import zmq


def allow_ipv6(sock: zmq.Socket, endpoint: str) -> None:
    """Let `sock` bind or connect `endpoint` over IPv6 when it names a bracketed IPv6 address
    (tcp://[::1]:5555, tcp://[fd00::5]:5555): ZeroMQ sockets speak IPv4 only unless told, and
    refused such an address as "No such device". Call before `bind` or `connect`."""
    if endpoint.startswith("tcp://") and "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
