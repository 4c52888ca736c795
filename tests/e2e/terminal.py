"""A real terminal for tests: a tmux session running one command, read with capture-pane and
typed into with send-keys. `available()` says why not when tmux is missing."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path


def available() -> str | None:
    return None if shutil.which("tmux") else "tmux is not installed"


class Terminal:
    def __init__(self, command: list[str], cwd: Path, width: int = 160, height: int = 50) -> None:
        self.name = "ddpkit-" + uuid.uuid4().hex[:8]
        self.done = cwd / f".{self.name}.rc"
        # the exit code lands in a file; the pane stays open to be read
        # COLUMNS and LINES (pytest-xdist sets 80x24) would override the pane's size for
        # programs that ask for it (rich does); the tmux server may hold them from whichever
        # test started it, so they are unset in the command itself
        # `trap : INT`: Ctrl+C reaches the command (its handlers reset to the default), and the
        # shell lives on to write the exit code (a shell without it dies with its child)
        line = (
            f"trap : INT; unset COLUMNS LINES; {shlex.join(command)}; "
            f"echo $? > {shlex.quote(str(self.done))}; sleep 600"
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TMUX") and k not in ("COLUMNS", "LINES")
        }
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height)]
            + ["-c", str(cwd), "bash", "--norc", "--noprofile", "-c", line],
            check=True,
            env=env,
        )

    def screen(self) -> str:
        out = subprocess.run(
            ["tmux", "capture-pane", "-p", "-J", "-S", "-2000", "-t", self.name],
            capture_output=True,
            text=True,
        )
        return out.stdout

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} on the screen in {timeout} s:\n{self.screen()}")

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def exit_code(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.done.exists() and self.done.read_text().strip():
                return int(self.done.read_text())
            time.sleep(0.1)
        raise AssertionError(f"the command did not end in {timeout} s:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)
