"""The emulated cluster's host settings as a user writes them: link rates (``100mbit``), each
host's own rate or share of a core (``HOST:VALUE[,...]``), and what ``tbf`` makes of a rate
(its token bucket, the payload share of a frame). Checked into one-line errors; no side effects.
"""

from __future__ import annotations

import re

from shoal.core.cpulimit import check_fraction
from shoal.errors import ShoalError

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate like ``100mbit`` or ``1gbit``; a one-line error otherwise."""
    m = _RATE.match(rate.strip())
    if not m or float(m.group(1)) <= 0:
        raise ShoalError(f"bandwidth {rate!r}: expected a rate like 100mbit, 1gbit or 500kbit")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


#: The share of a link's rate that carries a TCP stream's payload: ``tbf`` counts whole
#: Ethernet frames, 1,514 bytes for 1,448 of payload (1500-byte MTU, IPv4 and TCP headers
#: with timestamps).
PAYLOAD = 1448 / 1514


def burst_bytes(bits: float) -> int:
    """The token bucket of a link of ``bits`` per second: 10 ms worth of bytes (at least
    15,000, ``tbf``'s minimum for a 1500-byte MTU). A link idle that long passes that many
    bytes at once, at the machine's speed; the cost model counts it
    (:class:`shoal.strategies.cost.Network`'s ``burst_bytes``)."""
    return max(15_000, int(bits / 8 / 100))


def host_values(text: str, flag: str) -> dict[int, str]:
    """``HOST:VALUE[,HOST:VALUE...]`` (``--emulate-slow 1:0.25,2:0.5``) as ``{host: value}``;
    a one-line error naming ``flag`` for anything else."""
    out: dict[int, str] = {}
    for item in text.split(","):
        host, sep, value = item.strip().partition(":")
        if not sep or not host.strip().isdigit() or not value.strip():
            raise ShoalError(f"{flag} {text!r}: expected HOST:VALUE[,HOST:VALUE...] with HOST "
                             f"a host's index (0, 1, ...), e.g. {flag} 1:0.25")
        if int(host) in out:
            raise ShoalError(f"{flag} {text!r}: host {int(host)} is given twice")
        out[int(host)] = value.strip()
    return out


def slow_hosts(text: str, flag: str = "--emulate-slow") -> dict[int, float]:
    """``--emulate-slow HOST:FRACTION[,...]``: each host's fraction of one core, checked."""
    out = {}
    for host, value in host_values(text, flag).items():
        try:
            fraction = float(value)
        except ValueError:
            raise ShoalError(f"{flag} {host}:{value}: the fraction must be a number") from None
        out[host] = check_fraction(fraction, f"{flag} {host}:{value}")
    return out


def link_rates(text: str, flag: str = "--link-rate") -> dict[int, str]:
    """``--link-rate HOST:RATE[,...]``: each host's own link rate (``10mbit``), checked."""
    out = host_values(text, flag)
    for rate in out.values():
        rate_bits(rate)
    return out


__all__ = ["PAYLOAD", "burst_bytes", "host_values", "link_rates", "rate_bits", "slow_hosts"]
