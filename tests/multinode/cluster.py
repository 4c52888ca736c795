"""Machines for multi-node tests: N network namespaces on one bridge, each with its own address
in 198.18.0.0/15 (reserved for network tests, never routed), its own hostname (`unshare -u`) and
its own /etc/hosts naming every node. Nothing is on loopback pretending to be another machine:
a wrong address fails here as it would between real machines.

`Cluster.start(k, argv)` runs a command "on node k"; `cut(k)`/`heal(k)` take node k's link
down and up; `close()` removes everything. Needs root and iproute2; `available()` says why not.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


@dataclass
class Node:
    index: int
    netns: str
    host: str
    addr: str
    veth: str  # the bridge's end of this node's link


@dataclass
class Proc:
    """A process on a node, its output read as it comes."""

    node: Node
    popen: subprocess.Popen
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stdout or text in self.stderr:
                return
            if self.popen.poll() is not None:
                time.sleep(0.3)
                if text in self.stdout or text in self.stderr:
                    return
                raise AssertionError(
                    f"node {self.node.host} exited ({self.popen.returncode}) before {text!r}:\n"
                    f"{self.stdout}\n{self.stderr}"
                )
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} on {self.node.host} in {timeout} s:\n{self.stderr}")

    def finish(self, timeout: float = 90) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(
                f"{self.node.host} still running after {timeout} s:\n{self.stdout}\n{self.stderr}"
            ) from None
        finally:
            time.sleep(0.2)  # the reader threads take the last lines


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = f"ddpkprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Cluster:
    def __init__(self, nodes: int) -> None:
        tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        subnet = random.randrange(1, 250)  # 198.18.<subnet>.0/24, one per cluster
        self.bridge = f"dkbr{tag}"
        self.nodes = [
            Node(i, f"dk{tag}n{i}", f"node{i}", f"198.18.{subnet}.{i + 1}", f"dkv{tag}{i}")
            for i in range(nodes)
        ]
        self.procs: list[Proc] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # as a site's DNS would: names both ways, for IPv4 and IPv4-mapped IPv6 peers (a
        # dual-stack server sees ::ffff:a.b.c.d), so no lookup waits for a DNS server
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{n.addr} {n.host}\n::ffff:{n.addr} {n.host}\n" for n in self.nodes
        )
        for n in self.nodes:
            _ip("netns", "add", n.netns)
            _ip("link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
            _ip("link", "set", n.veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{n.addr}/24", "dev", "eth0", netns=n.netns)
            _ip("link", "set", "eth0", "up", netns=n.netns)
            _ip("link", "set", "lo", "up", netns=n.netns)
            etc = NETNS_ETC / n.netns  # `ip netns exec` mounts these over /etc
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(n.host + "\n")

    def argv(self, node: int, argv: list[str]) -> list[str]:
        """`argv` as run on node `node`: its network, its hostname, its /etc/hosts."""
        n = self.nodes[node]
        script = f'hostname {n.host} && exec "$@"'
        return ["ip", "netns", "exec", n.netns, "unshare", "-u", "sh", "-c", script, "sh", *argv]

    def start(
        self, node: int, argv: list[str], cwd: Path | None = None, env: dict | None = None
    ) -> Proc:
        environment = {**os.environ, **(env or {})}
        environment.pop("GLOO_SOCKET_IFNAME", None)  # each node finds its own interface
        popen = subprocess.Popen(
            self.argv(node, argv),
            cwd=cwd,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        proc = Proc(self.nodes[node], popen)
        for pipe, sink in ((popen.stdout, proc.out), (popen.stderr, proc.err)):
            threading.Thread(target=_read, args=(pipe, sink), daemon=True).start()
        self.procs.append(proc)
        return proc

    def run(
        self, node: int, argv: list[str], timeout: float = 30, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        cmd = self.argv(node, argv)
        environment = {**os.environ, **(env or {})}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environment)

    def cut(self, node: int) -> None:
        """Node `node` loses its link to every other node (as a pulled cable)."""
        _ip("link", "set", self.nodes[node].veth, "down")

    def heal(self, node: int) -> None:
        _ip("link", "set", self.nodes[node].veth, "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
        for n in self.nodes:
            subprocess.run(["ip", "netns", "del", n.netns], capture_output=True)
            shutil.rmtree(NETNS_ETC / n.netns, ignore_errors=True)
            subprocess.run(["ip", "link", "del", n.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _read(pipe, sink: list[str]) -> None:
    for line in iter(pipe.readline, ""):
        sink.append(line)
    pipe.close()
