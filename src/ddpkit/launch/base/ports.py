"""Ports for the job's store: a free one held open from the moment it is chosen (no race), or
the user's, checked, with the process that holds it named when it is busy."""

from __future__ import annotations

import socket

from ddpkit.errors import LaunchError


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on host:port (port 0: the kernel picks a free one). The launcher
    keeps it and hands it to the store, so no other process can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        holder, training = port_holder(port)
        by = f" by {holder}" if holder else ""
        raise LaunchError(
            f"port {port} on {host or 'all interfaces'} is already in use{by} ({err.strerror})",
            fix="pick another with --master-port, or leave it out and ddpkit picks a free one"
            + (f"; `ddpkit kill {holder.split()[1]}` ends that job" if training else ""),
        ) from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def port_holder(port: int) -> tuple[str, bool]:
    """('pid N (command)', whether it is a training process) of what listens on `port`."""
    from ddpkit.common.procs import port_holder as holder

    text, job = holder(port)
    return text, job is not None


def warn_privileged(port: int) -> str | None:
    if 0 < port < 1024:
        return (
            f"--master-port {port} is a privileged port (below 1024): it needs root and "
            "clashes with system services; fix: use a port above 1024, or leave it out"
        )
    return None
