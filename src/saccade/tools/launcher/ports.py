"""Whose is a port? The launcher's servers listen on fixed ports, so a port some other process
already holds (a server left from an earlier run, another user's) must be refused by name
before our server starts, and a URL that answers must be answered by our server, not by a
stranger that bound the port first (Linux: /proc/net/tcp and each process's /proc/PID/fd).
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from urllib.parse import urlsplit

LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def url_port(url: str) -> int:
    """The port of a server's base URL (http://host:port)."""
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{url} names no port")
    return port


def port_taken(port: int) -> bool:
    """True when a listening socket holds `port` on some address of this machine (a bind to every
    address fails). SO_REUSEADDR, as the servers set it, so that a port left in TIME_WAIT by our
    own server's last life counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets listening on `port` (IPv4 and IPv6); empty where /proc/net is
    not there to read (then nobody can be named)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def holders(inodes: set[int], proc: Path = Path("/proc")) -> list[int]:
    """The pids with one of the sockets `inodes` open (those whose fds this user may read)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    found = []
    for entry in proc.iterdir() if wanted else ():
        if not entry.name.isdigit():
            continue
        try:
            if any(_link(fd) in wanted for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or another user's
    return sorted(found)


def _link(path: Path) -> str | None:
    try:
        return str(path.readlink())
    except OSError:
        return None


def describe(pids: list[int], proc: Path = Path("/proc")) -> str:
    """'pid 123 (python -m http.server 8000)', for an error message; a process this user cannot
    see is said so."""
    if not pids:
        return "a process this user cannot see (another user's)"
    described = []
    for pid in pids:
        try:
            command = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        described.append(f"pid {pid} ({command[:120]})")
    return ", ".join(described)


def foreign_listener(port: int, ours: set[int]) -> str | None:
    """Who else listens on `port`, described, when a socket listens on it and none of `ours` holds
    it; None when ours holds it or nothing can be seen (no /proc/net: nothing to say)."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    pids = holders(inodes)
    if set(pids) & ours:
        return None
    return describe(pids)
