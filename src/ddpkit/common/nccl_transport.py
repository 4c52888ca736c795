"""Which transport NCCL chose, read from NCCL's own INFO log, and whether a faster one exists.

NCCL logs every connection it makes (`NCCL_DEBUG=INFO`): `Channel 00/0 : 0[0] -> 1[1] via
P2P/CUMEM/read` between two GPUs of one machine (P2P: NVLink or PCIe peer access, CUMEM/IPC
being how the memory is shared), `via SHM/direct/direct` (through host memory), `[send] via
NET/IB/0/GDRDMA` or `via NET/Socket/0` to another machine, `via P2P/indirect/...`, and which
network it loaded (`Using network IB`, `NET/Socket : Using [0]eth0:...`), NVLink SHARP
(`NVLS multicast support is available`, `Connected NVLS tree`) and CollNet. `ddpkit run` writes
that log into the run folder (never to the console) unless the user set NCCL_DEBUG; this module
reads it: what was chosen between each pair of GPUs of a machine and between machines, and a
warning when a slower path was taken though a faster one exists (SHM between NVLinked GPUs, as
NCCL_P2P_DISABLE=1 makes it; sockets between machines that have InfiniBand; a socket on a
slower interface than another that is up). No torch here.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

LOG_PATTERN = "nccl-%h-%p.log"  # NCCL_DEBUG_FILE: %h host, %p pid (NCCL expands both)
_PREFIX = re.compile(r"^(?P<host>[^:\s]+):\d+:\d+ \[(?P<dev>\d+)\] NCCL INFO (?P<text>.*)$")
_CHANNEL = re.compile(
    r"Channel \d+(?:/\d+)? : (?P<src>\d+)\[(?P<sdev>\d+)\] -> (?P<dst>\d+)\[(?P<ddev>\d+)\]"
    r"(?: \[(?P<dir>send|receive)\])? via (?P<via>\S+(?: pointer)?)"
)
_SOCKET = re.compile(r"NET/Socket : Using(?P<ifs>(?: \[\d+\][^\s:]+:[^\s]+)+)")
_SOCKET_IF = re.compile(r"\[\d+\](?P<name>[^\s:]+):")

# one-way GB/s a transport reaches at best here, for "how far is bench from it" (docs/bench.md)
KINDS = ("P2P", "SHM", "NET/IB", "NET/Socket", "NVLS", "CollNet")


@dataclass
class Transport:
    """What one machine's NCCL log says it chose."""

    host: str = ""
    ranks: int = 0  # the communicator's size, as logged ("nRanks N")
    local: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (gpu, gpu) -> kinds
    remote: set[str] = field(default_factory=set)  # kinds used toward other machines
    network: str = ""  # "IB", "Socket", a plugin's name
    socket_ifs: list[str] = field(default_factory=list)  # interfaces NET/Socket uses
    nvls: bool = False
    collnet: bool = False
    files: int = 0
    seen: int = 0  # NCCL INFO lines read

    def line(self) -> str:
        """One line: `GPU0<->GPU1 P2P/CUMEM; to other nodes NET/IB (IB); NVLS`."""
        if self.seen == 0:
            return "no NCCL log yet"
        parts = []
        pairs: dict[str, list[str]] = {}
        for (a, b), kinds in sorted(self.local.items()):
            pairs.setdefault("+".join(sorted(kinds)), []).append(f"GPU{a}<->GPU{b}")
        for label, names in pairs.items():
            shown = names if len(names) <= 3 else [*names[:2], f"... ({len(names)} pairs)"]
            parts.append(f"{', '.join(shown)} {label}")
        if self.remote:
            net = f" ({self.network})" if self.network else ""
            parts.append(f"to other nodes {'+'.join(sorted(self.remote))}{net}")
        if self.nvls:
            parts.append("NVLS (NVLink SHARP)")
        if self.collnet:
            parts.append("CollNet")
        if not parts:
            return "one rank per machine and no other machine: NCCL moves no data between GPUs"
        return "; ".join(parts)


def kind_of(via: str) -> str:
    """`P2P/CUMEM/read` -> `P2P/CUMEM`; `NET/IB/0/GDRDMA` -> `NET/IB`; `SHM/direct/direct` ->
    `SHM`."""
    parts = via.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        return f"NET/{parts[1]}"
    if parts[0] == "P2P" and len(parts) > 1:
        return f"P2P/{parts[1].split()[0]}"
    return parts[0]


def parse(lines: list[str], host: str | None = None) -> Transport:
    """What the log lines say (lines of other hosts are left out when `host` is given)."""
    found = Transport(host=host or "")
    device_of: dict[int, int] = {}  # rank -> its GPU, for the ranks on this machine
    links: list[tuple[int, int, int, int, str]] = []
    for raw in lines:
        m = _PREFIX.match(raw.strip())
        if m is None or (host and m["host"] != host):
            continue
        found.host = found.host or m["host"]
        found.seen += 1
        text = m["text"]
        channel = _CHANNEL.search(text)
        if channel is not None:
            src, dst = int(channel["src"]), int(channel["dst"])
            sdev, ddev = int(channel["sdev"]), int(channel["ddev"])
            device_of[src] = sdev
            links.append((src, sdev, dst, ddev, kind_of(channel["via"])))
            continue
        if text.startswith("CollNet ") and " via COLLNET/" in text:
            found.collnet = True
        elif text.startswith("Using network "):
            found.network = text.split("Using network ", 1)[1].strip()
        elif (socket := _SOCKET.search(text)) is not None:
            found.socket_ifs = [i["name"] for i in _SOCKET_IF.finditer(socket["ifs"])]
        elif text.startswith(("Connected NVLS", "NVLS comm")):
            found.nvls = True
        elif (size := re.search(r"\bnRanks (\d+)", text)) is not None:
            found.ranks = max(found.ranks, int(size[1]))
    for _, sdev, dst, ddev, kind in links:
        if kind.startswith("NET/"):
            found.remote.add(kind)
        elif dst in device_of or kind in ("SHM",) or kind.startswith("P2P"):
            a, b = sorted((sdev, ddev))
            if a != b:
                found.local.setdefault((a, b), set()).add(kind)
    return found


def read(folder: Path, host: str | None = None) -> Transport:
    """This machine's NCCL logs in a run folder (NCCL_DEBUG_FILE=LOG_PATTERN)."""
    files = sorted(glob.glob(str(folder / "nccl-*.log")))
    lines: list[str] = []
    for name in files:
        try:
            with open(name, errors="replace") as f:
                lines.extend(f.readlines())
        except OSError:
            continue
    found = parse(lines, host)
    found.files = len(files)
    return found


def complete(folder: Path) -> bool:
    """Whether NCCL has finished connecting (its init logs `Init COMPLETE`)."""
    for name in glob.glob(str(folder / "nccl-*.log")):
        try:
            with open(name, errors="replace") as f:
                if "Init COMPLETE" in f.read():
                    return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class SlowPath:
    """A slower path NCCL took though a faster one exists: what, and the fix."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; fix: {self.fix}"


def warnings(
    found: Transport,
    nvlinked: bool,
    infiniband: list[str],
    interfaces: dict[str, int],
    environ: dict[str, str] | None = None,
) -> list[SlowPath]:
    """Slower paths taken though faster ones exist. `nvlinked`: this machine's GPUs have
    active NVLinks (NVML); `infiniband`: its IB devices; `interfaces`: name -> Mb/s of the
    network interfaces that are up."""
    env = os.environ if environ is None else environ
    said = []
    slow_local = sorted(
        (a, b) for (a, b), kinds in found.local.items() if kinds & {"SHM"} or any(
            k.startswith("NET/") for k in kinds)
    )  # fmt: skip
    if slow_local and nvlinked:
        a, b = slow_local[0]
        why = (
            "NCCL_P2P_DISABLE=1 is set"
            if env.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
            else "peer access between them is off (NCCL_P2P_LEVEL, ACS or IOMMU settings?)"
        )
        said.append(
            SlowPath(
                f"NCCL goes through host memory (SHM) between GPU{a} and GPU{b}, which are "
                f"NVLinked: {why}",
                "unset NCCL_P2P_DISABLE (NCCL then uses NVLink)",
            )
        )
    if "NET/Socket" in found.remote and infiniband:
        why = (
            "NCCL_IB_DISABLE=1 is set"
            if env.get("NCCL_IB_DISABLE", "0") not in ("", "0")
            else "NCCL did not use them (driver, rdma-core or NCCL_IB_HCA?)"
        )
        said.append(
            SlowPath(
                f"NCCL uses TCP sockets between nodes, and this node has InfiniBand "
                f"({', '.join(infiniband)}): {why}",
                "unset NCCL_IB_DISABLE, check `ibstat`",
            )
        )
    if "NET/Socket" in found.remote and found.socket_ifs and interfaces:
        used = {i: interfaces.get(i, 0) for i in found.socket_ifs}
        fastest = max(interfaces, key=lambda i: interfaces[i])
        if interfaces[fastest] > max(used.values(), default=0) * 1.5 and fastest not in used:
            said.append(
                SlowPath(
                    f"NCCL's sockets use {', '.join(f'{i} ({s} Mb/s)' for i, s in used.items())} "
                    f"though {fastest} ({interfaces[fastest]} Mb/s) is up",
                    f"NCCL_SOCKET_IFNAME={fastest}",
                )
            )
    return said


def interface_speeds(root: str = "/sys/class/net") -> dict[str, int]:
    """Mb/s of each network interface that is up and says its speed (loopback left out)."""
    speeds = {}
    for path in glob.glob(f"{root}/*"):
        name = os.path.basename(path)
        if name == "lo":
            continue
        try:
            if Path(path, "operstate").read_text().strip() != "up":
                continue
            speed = int(Path(path, "speed").read_text().strip())
        except (OSError, ValueError):
            continue
        if speed > 0:
            speeds[name] = speed
    return speeds
