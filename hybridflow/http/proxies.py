"""What a trusted reverse proxy says about a request: the client's address
(``X-Forwarded-For``) and whether the client came over https (``X-Forwarded-Proto``).

Only a proxy the service trusts (``trusted_proxies``: IP addresses and networks, loopback
by default) is believed; any other peer could write those headers itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network, ip_address

from fastapi import Request

Network = IPv4Network | IPv6Network


def trusted(host: str | None, proxies: Sequence[Network]) -> bool:
    """Whether ``host`` (an IP address as text) lies in one of the trusted networks."""
    if not host:
        return False
    try:
        address = ip_address(host)
    except ValueError:
        return False
    return any(address.version == network.version and address in network for network in proxies)


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


def client_address(request: Request, proxies: Sequence[Network]) -> str:
    """The address of the client behind the proxies: from the connection's peer, walking
    ``X-Forwarded-For`` from its right end (the nearest hop) past every trusted proxy. An
    untrusted peer is the client itself, whatever it writes in the header."""
    address = _peer(request) or "unknown"
    if not trusted(address, proxies):
        return address
    hops = [hop.strip() for header in request.headers.getlist("x-forwarded-for") for hop in header.split(",")]
    for hop in reversed([hop for hop in hops if hop]):
        address = hop
        if not trusted(hop, proxies):
            break
    return address


def came_over_https(request: Request, proxies: Sequence[Network]) -> bool:
    """Whether the client used https: to this server, or (as a trusted proxy says in
    ``X-Forwarded-Proto``) to a proxy on the way. Any https hop counts: a Secure cookie
    over plain http is only refused by the browser that asked for it."""
    if request.url.scheme == "https":
        return True
    if not trusted(_peer(request), proxies):
        return False
    hops = {hop.strip().lower() for header in request.headers.getlist("x-forwarded-proto") for hop in header.split(",")}
    return "https" in hops
