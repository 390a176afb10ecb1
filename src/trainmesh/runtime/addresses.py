"""Addresses checked at the door: no networking, just the text.

A port outside 1..65535, an empty host or the same address twice is a ``ValueError`` that names
the variable (or option) and the value it came from, raised before any connection is tried,
instead of a bare ``Port out of range`` from deep inside a connect, or a job that waits for a
peer that can never come.

>>> parse_address("node1:29500", name="MASTER")
('node1', 29500)
>>> parse_address("node1:99999", name="MASTER")
Traceback (most recent call last):
ValueError: port 99999 is outside 1..65535. Received: MASTER='node1:99999'
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Mapping, Sequence

MAX_PORT = 65535
_HOST_PORT = re.compile(r"\[(?P<h6>[^\]]*)\](?::(?P<p6>[^:]*))?|(?P<h>[^:]*)(?::(?P<p>[^:]*))?")


def split_host_port(address: str, default_port: int | None) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` / ``"host"`` -> (host, port); ValueError with the reason only."""
    text = address.strip()
    if not text:
        raise ValueError("the address is empty")
    m = _HOST_PORT.fullmatch(text)
    if m is None:
        raise ValueError("expected HOST:PORT (or [IPv6]:PORT)")
    host = m.group("h6") if m.group("h6") is not None else m.group("h")
    port_text = m.group("p6") if m.group("h6") is not None else m.group("p")
    if not host.strip():
        raise ValueError("the host is empty")
    if port_text is None:
        if default_port is None:
            raise ValueError("the port is missing")
        return host, default_port
    if not port_text.strip().isdigit():
        raise ValueError(f"the port {port_text!r} is not a number")
    return host, check_port(int(port_text))


def check_port(port: int) -> int:
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"port {port} is outside 1..{MAX_PORT}")
    return port


def parse_address(address: str, *, name: str, default_port: int | None = None) -> tuple[str, int]:
    """:func:`split_host_port`, its error naming ``name`` and the value."""
    try:
        return split_host_port(address, default_port)
    except ValueError as exc:
        raise ValueError(f"{exc}. Received: {name}={address!r}") from None


def check_distinct(entries: Iterable[tuple[str, tuple[str, int]]], *, name: str, value: object) -> None:
    """``entries`` are (label, (host, port)); the same (host, port) under two labels is an error."""
    seen: dict[tuple[str, int], str] = {}
    for label, pair in entries:
        if pair in seen:
            raise ValueError(
                f"{seen[pair]} and {label} are the same address {pair[0]}:{pair[1]}; every "
                f"process needs its own. Received: {name}={value!r}"
            )
        seen[pair] = label


def env_host(env: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The first of ``names`` that is set (an empty value counts as unset); a blank one is an error."""
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        if not value.strip():
            raise ValueError(f"{name} is blank: the host is empty. Received: {name}={value!r}")
        return value.strip()
    return None


def env_port(env: Mapping[str, str], names: Sequence[str]) -> int | None:
    """The first of ``names`` that is set, as a port in 1..65535."""
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            port = int(value)
        except ValueError:
            raise ValueError(f"Environment variable {name} must be an integer. Received: {name}={value!r}") from None
        try:
            return check_port(port)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}. Received: {name}={value!r}") from None
    return None


def expand_slurm_nodelist(nodelist: str, *, name: str) -> list[str]:
    """``node[003-004,9],gpu1`` -> ``['node003', 'node004', 'node9', 'gpu1']``; empty hosts, bad
    ranges and duplicates are errors naming ``name``."""

    def fail(why: str) -> ValueError:
        return ValueError(f"{name} {why}. Received: {name}={nodelist!r}")

    def expand(entry: str) -> list[str]:
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]*)\](.*)", entry)
        if m is None:
            if "[" in entry or "]" in entry:
                raise fail(f"has an unbalanced bracket in {entry!r}")
            return [entry]
        prefix, ranges, rest = m.groups()
        hosts = []
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
                raise fail(f"has a bad range {item!r} in {entry!r}")
            hosts += [f"{prefix}{i:0{len(low)}d}" for i in range(int(low), int(high or low) + 1)]
        return [host + tail for host in hosts for tail in expand(rest)]

    entries, depth, current = [], 0, ""
    for char in nodelist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries.append(current)
    hosts = []
    for entry in entries:
        if not entry.strip():
            raise fail("has an empty host")
        hosts += expand(entry.strip())
    duplicates = sorted(host for host, count in Counter(hosts).items() if count > 1)
    if duplicates:
        raise fail(f"names {', '.join(duplicates)} more than once")
    return hosts


def parse_server_list(raw: str, *, name: str) -> list[str]:
    """A comma-separated list of parameter-server addresses (``tcp://HOST:PORT`` or ``HOST:PORT``,
    ``ipc://PATH``, ``inproc://NAME``), checked; returned as given, stripped."""
    addresses = [part.strip() for part in raw.split(",")]
    if not raw.strip() or any(not a for a in addresses):
        raise ValueError(f"{name} has an empty address. Received: {name}={raw!r}")
    pairs = []
    for i, address in enumerate(addresses):
        scheme, sep, rest = address.partition("://")
        if not sep:
            scheme, rest = "tcp", address
        if scheme in ("ipc", "inproc"):
            if not rest:
                raise ValueError(f"{name} entry {i} has an empty {scheme} name. Received: {name}={raw!r}")
            pairs.append((f"entry {i} ({address})", (f"{scheme}://{rest}", 0)))
            continue
        if scheme != "tcp":
            raise ValueError(
                f"{name} entry {i} uses {scheme}://; use tcp://, ipc:// or inproc://. Received: {name}={raw!r}"
            )
        try:
            pairs.append((f"entry {i} ({address})", split_host_port(rest, None)))
        except ValueError as exc:
            raise ValueError(f"{name} entry {i} ({address!r}): {exc}. Received: {name}={raw!r}") from None
    check_distinct(pairs, name=name, value=raw)
    return addresses
