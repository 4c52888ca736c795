"""The front door: the classic guide's habits, tried as its reader tries them. A rank started by
hand without its peers says within a second what it waits for, ends on Ctrl+C at once in
ddpkit's words (a real terminal), and keeps the stated timeout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e import terminal
from tests.e2e.helpers import SCRIPTS, bound

pytestmark = pytest.mark.timeout(200)
BY_HAND = str(SCRIPTS / "joins_by_hand.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def called_setup_at(screen: str) -> float:
    found = re.search(r"calling setup at (\d+\.\d+)", screen)
    assert found, screen
    return float(found.group(1))


@pytest.mark.skipif(terminal.available() is not None, reason=str(terminal.available()))
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_started_by_hand_says_what_it_waits_for_and_ctrl_c_ends_it_at_once(tmp_path, rank):
    port = free_port()
    command = [
        "env",
        f"RANK={rank}",
        "WORLD_SIZE=2",
        f"MASTER_PORT={port}",
        sys.executable,
        BY_HAND,
    ]
    term = terminal.Terminal(command, tmp_path)
    try:
        screen = term.wait_for("Ctrl+C stops it", bound(30))
        said_after = time.time() - called_setup_at(screen)
        assert said_after < bound(2), f"said {said_after:.1f} s after setup() was called"
        if rank == 1:
            assert f"rank 1 of 2 waits for rank 0 to listen at 127.0.0.1:{port}" in screen
        else:
            assert f"rank 0 of 2 listens on 127.0.0.1:{port} and waits for rank 1" in screen
        assert "RANK and WORLD_SIZE set by hand" in screen
        assert "it waits up to 300 s" in screen
        pressed = time.monotonic()
        term.keys("C-c")
        code = term.exit_code(bound(10))
        took = time.monotonic() - pressed
        screen = term.screen()
    finally:
        term.close()
    assert took < bound(1.5), f"Ctrl+C took {took:.1f} s"
    assert code == 130, screen
    assert "error: interrupted at setup()" in screen
    assert "fix: start every rank at once with a launcher: `ddpkit run -n 2" in screen
    assert "Traceback" not in screen, "ddpkit's words, no traceback"
    assert "TCP client" not in screen, "none of torch's C++ lines"
    assert "frame #" not in screen


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_started_by_hand_keeps_the_stated_init_timeout(tmp_path, rank):
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "DDPKIT_INIT_TIMEOUT": "4",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    out = subprocess.run([sys.executable, BY_HAND], env=env, capture_output=True, text=True,
                         timeout=bound(60), cwd=tmp_path)  # fmt: skip
    ended = time.time()
    took = ended - called_setup_at(out.stdout)
    assert out.returncode == 1, out.stderr
    assert 4 <= took < 4 + bound(2), f"4 s asked, {took:.1f} s taken"
    if rank == 1:
        assert "error: rank 1 could not reach rank 0 at 127.0.0.1" in out.stderr
    else:
        assert "error: 1 of 2 ranks arrived at init within 4 s; missing: rank 1" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "frame #" not in out.stderr, out.stderr
