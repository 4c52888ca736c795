"""`ddpkit.spawn` in a Jupyter kernel, driven headlessly as a notebook's cells are
(jupyter_client, a real ipykernel): a function defined in a cell runs on every rank (each a
fork of the kernel), its `[rank N]` output and ddpkit's summary in the cell; a second call in
the same kernel works; interrupting the kernel ends every rank and the cell shows the summary
and KeyboardInterrupt; shutting the kernel down leaves no process."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.e2e.helpers import bound

manager = pytest.importorskip("jupyter_client.manager")
pytestmark = pytest.mark.timeout(180)

DEFINE = """
import time
import torch
import torch.distributed as dist
import ddpkit

def train(rank, steps):
    dist.init_process_group("gloo")
    total = torch.ones(1) * rank
    dist.all_reduce(total)
    for step in range(steps):
        time.sleep(0.05)
        dist.barrier()
    world = dist.get_world_size()
    print(f"rank {rank} of {world}: sum {total.item():g}, {steps} steps", flush=True)
    dist.destroy_process_group()
"""


class Kernel:
    def __init__(self, tmp_path) -> None:
        self.km, self.kc = manager.start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
        self.pid = self.km.provisioner.process.pid
        self.run(f"import os; os.environ['DDPKIT_LOG_DIR'] = {str(tmp_path / 'logs')!r}")

    def run(self, code: str, timeout: float = 120) -> str:
        """The cell's output as a notebook shows it: its streams, then its error, if any."""
        msg_id = self.kc.execute(code)
        said = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                said.append(content["text"])
            elif kind == "error":
                said.append(f"\nERROR {content['ename']}: {content['evalue']}\n")
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(said)
        raise AssertionError(f"the cell did not end within {timeout} s: {''.join(said)}")

    def ranks(self) -> list[psutil.Process]:
        try:
            return [p for p in psutil.Process(self.pid).children(recursive=True)
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        k.close()


def test_a_function_defined_in_a_cell_runs_on_every_rank_twice_in_one_kernel(kernel):
    kernel.run(DEFINE)
    for _ in range(2):  # a second call in the same kernel works
        cell = kernel.run("ddpkit.spawn(train, args=(4,), nprocs=3)")
        for rank in range(3):
            assert f"[rank {rank}] rank {rank} of 3: sum 3, 4 steps" in cell, cell
        assert "every rank exited 0" in cell, cell
        assert "ERROR" not in cell
        assert not kernel.ranks()


def test_a_failing_rank_raises_in_the_cell_with_its_root_cause(kernel):
    kernel.run(DEFINE)
    kernel.run("def fails(rank):\n    if rank == 1:\n        raise ValueError('bad batch')\n")
    cell = kernel.run("ddpkit.spawn(fails, nprocs=2)")
    assert "root cause: rank 1 exited with code 1 (ValueError: bad batch" in cell, cell
    assert "ERROR JobFailedError: the job ended with exit code 1: rank 1" in cell, cell
    assert not kernel.ranks()


def test_interrupting_the_kernel_ends_every_rank_and_the_cell_shows_the_summary(kernel):
    kernel.run(DEFINE)
    msg_id = kernel.kc.execute("ddpkit.spawn(train, args=(100000,), nprocs=2, grace=3)")
    deadline = time.monotonic() + bound(60)
    while len(kernel.ranks()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # the ranks are training
    kernel.km.interrupt_kernel()
    said, error = [], ""
    while not error:
        msg = kernel.kc.get_iopub_msg(timeout=bound(30))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = msg["content"]["ename"]
    cell = "".join(said)
    assert error == "KeyboardInterrupt", cell
    assert "ddpkit: the job was stopped" in cell, cell
    assert not kernel.ranks()
    assert "[rank 0] rank 0 of 2" not in kernel.run("print('the kernel goes on')")


def test_shutting_the_kernel_down_leaves_no_process(tmp_path):
    k = Kernel(tmp_path)
    k.run(DEFINE)
    k.kc.execute("ddpkit.spawn(train, args=(100000,), nprocs=2)")
    deadline = time.monotonic() + bound(60)
    while len(k.ranks()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = k.ranks()
    assert len(ranks) >= 2
    k.close()  # the kernel killed, as a notebook's shutdown or restart does
    gone, alive = psutil.wait_procs(ranks, timeout=bound(10))
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
