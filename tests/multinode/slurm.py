"""A real SLURM on the test nodes: munged, slurmctld on node 0 and one slurmd per node (`slurmd
-N nodeK`), each in its node's namespace, with a config of their own (nothing in /etc/slurm is
touched). Debian's slurm-wlm and munge; `available()` says why not when they are missing.

`Slurm.srun(argv)` runs `srun` on node 0 (the login node), `scancel` signals a job's steps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.multinode.cluster import Cluster, Proc

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "scancel", "squeue", "sinfo")


def available() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"SLURM is not installed (no {', '.join(missing)}: apt-get install slurm-wlm munge)"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key)"
    return None


class Slurm:
    def __init__(self, cluster: Cluster, folder: Path) -> None:
        self.cluster = cluster
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[Proc] = []
        self.munged: int | None = None  # the munged this harness started, if any
        self._start_munge()
        self._write_conf()
        ctl = cluster.nodes[0]
        self.daemons.append(
            cluster.start(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env)
        )
        for n in cluster.nodes:
            self.daemons.append(
                cluster.start(
                    n.index, ["slurmd", "-D", "-N", n.host, "-f", str(self.conf)], env=self.env
                )
            )
        self._wait_idle(ctl.host)

    def _start_munge(self) -> None:
        socket = Path("/run/munge/munge.socket.2")
        if socket.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True)
        for _ in range(50):
            if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
                pid_file = Path("/run/munge/munged.pid")
                self.munged = int(pid_file.read_text()) if pid_file.exists() else None
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not start")

    def _write_conf(self) -> None:
        spool = self.folder / "spool"
        for n in self.cluster.nodes:
            (spool / f"slurmd-{n.host}").mkdir(parents=True, exist_ok=True)
        # cgroups only for what slurmd insists on; processes are tracked by their parent pid
        (self.folder / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nIgnoreSystemd=yes\n"
        )
        nodes = "".join(
            f"NodeName={n.host} NodeAddr={n.addr} CPUs={os.cpu_count() or 2} State=UNKNOWN\n"
            for n in self.cluster.nodes
        )
        ctl = self.cluster.nodes[0]
        self.conf.write_text(
            f"""ClusterName=ddpkit
SlurmctldHost={ctl.host}({ctl.addr})
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
SlurmctldPidFile={spool}/slurmctld.pid
SlurmdPidFile={spool}/slurmd-%n.pid
SlurmdSpoolDir={spool}/slurmd-%n
StateSaveLocation={spool}/ctld
SlurmctldLogFile={spool}/slurmctld.log
SlurmdLogFile={spool}/slurmd-%n.log
KillWait=5
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _wait_idle(self, host: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            run = self.cluster.run(0, ["sinfo", "-h", "-o", "%T %D"], 10, self.env)
            out = run.stdout + run.stderr
            count = len(self.cluster.nodes)
            if out.split() == ["idle", str(count)]:
                return
            time.sleep(0.3)
        raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {out}")

    def srun(self, argv: list[str], cwd: Path, env: dict | None = None) -> Proc:
        return self.cluster.start(0, ["srun", *argv], cwd=cwd, env={**self.env, **(env or {})})

    def jobs(self) -> list[str]:
        run = self.cluster.run(0, ["squeue", "-h", "-o", "%i"], 10, self.env)
        return run.stdout.split()

    def scancel(self, *args: str) -> subprocess.CompletedProcess:
        return self.cluster.run(0, ["scancel", *args], 10, self.env)

    def close(self) -> None:
        for job in self.jobs():
            self.scancel("--signal=KILL", job)
        for d in self.daemons:
            if d.popen.poll() is None:
                d.popen.terminate()
        for d in self.daemons:
            try:
                d.popen.wait(10)
            except subprocess.TimeoutExpired:
                d.popen.kill()
                d.popen.wait()
        if self.munged is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.munged, signal.SIGTERM)
