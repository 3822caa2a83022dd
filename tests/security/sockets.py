"""Listening sockets of a process tree, from /proc (Linux): what a test needs to see who listens where."""

from __future__ import annotations

import os
import socket
import struct


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (by parent pid in /proc/*/stat)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        todo.extend(kids)
    return out


def _inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[8:-1])
    except OSError:
        pass
    return found


def _addr(hex_addr: str, v6: bool) -> str:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if v6:
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
        return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{int(port, 16)}"
    return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"


def listening(pids: set[int]) -> list[tuple[int, str, str]]:
    """(pid, protocol, local address) of every listening TCP socket and bound UDP socket of `pids`."""
    owner = {ino: pid for pid in pids for ino in _inodes(pid)}
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{proto}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if inode in owner and (proto.startswith("udp") or state == "0A"):
                out.append((owner[inode], proto, _addr(local, proto.endswith("6"))))
    return out


def is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")
