"""Which producers a consumer may pull KV from (`kv_producers` in --kv-transfer-config).

A consumer is told where a prompt's KV is by the request's `kv_transfer_params`, which come in
the client's body. Connecting wherever they say would let any client make the server open
connections to any address (SSRF), so a consumer only pulls from producers it was given at
start: by default this host (its loopback addresses, and 0.0.0.0 / :: which a producer bound
to every interface names), otherwise the listed hosts, `host:port`s and networks (CIDR).
Hosts are matched as written (no name lookups): a name in the list matches that name only, an
address also its other spellings.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

THIS_HOST = ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::")  # the default kv_producers
_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class Peer:
    """One entry: a host name, an address or a network, with a port or any port."""

    host: str
    port: int | None = None
    net: _Net | None = None

    def allows(self, host: str, port: int | None) -> bool:
        if self.port is not None and port != self.port:
            return False
        ip = _ip(host)
        if self.net is not None:
            return ip is not None and ip.version == self.net.version and ip in self.net
        return host == self.host


def parse_peer(entry: str) -> Peer:
    """`host`, `host:port`, `[v6 address]:port`, an IPv6 address, or a network in CIDR form;
    ValueError says what is wrong with it."""
    if not isinstance(entry, str) or not entry.strip() or entry != entry.strip():
        raise ValueError(f"{entry!r} is not a host, host:port or network")
    host, port = entry, None
    if entry.startswith("["):
        inner, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r}: a bracketed address is [address] or [address]:port")
        host, port = inner, rest[1:] if rest else None
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    if port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{entry!r}: the port must be in 1-65535")
        port = int(port)
    if "/" in host:
        try:
            net = ipaddress.ip_network(host)
        except ValueError:
            raise ValueError(f"{entry!r} is not a network in CIDR form (e.g. 10.0.0.0/8)") from None
        return Peer(host, port, net)
    ip = _ip(host)
    if ip is not None:
        return Peer(host, port, ipaddress.ip_network(ip))
    if not host or any(c in host for c in ";/ []@"):
        raise ValueError(f"{entry!r} is not a host name or address")
    return Peer(host, port)


def allowed(peers: tuple[Peer, ...], host: str, port: int | None) -> bool:
    return any(p.allows(host, port) for p in peers)
