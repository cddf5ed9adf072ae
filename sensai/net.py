"""Network addresses, as the gateway's access rules and the Ray connection both read them."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an IP address, IPv6 in brackets or not, or ``localhost``) is this
    machine's loopback."""
    if host is None:
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
