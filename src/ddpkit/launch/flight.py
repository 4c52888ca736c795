"""NCCL flight recorder, on demand: the last collectives each rank issued, with their state.

PyTorch keeps a ring buffer of recent collectives per NCCL process group when
TORCH_FR_BUFFER_SIZE > 0 (ddpkit run sets 2000 unless set). The rank side
(`serve`, a daemon thread started once the rank's NCCL group exists) writes a dump when the
launcher drops a request file; the launcher side (`request`) asks every rank and reads what
came back. Torch builds without the recorder, or a rank whose Python cannot run, give none,
and the verdict goes on from stacks alone.

The hang watch polls every 2 s, so its poll asks only for each process group's status (last
enqueued and completed sequence numbers): 0.1 ms. A dump with the collectives took 10.75 ms
on an H200 rank with a full ring, and a training step it overlapped ran 17.8 ms slower
(benchmarks/RESULTS.md), so the full dump is kept for the hang report.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from pathlib import Path
from typing import Any

STATUS = "status"  # request-file content asking for the process groups' status only


def _paths(state_dir: Path, rank: int | str) -> tuple[Path, Path]:
    return state_dir / f"rank{rank}.fr-request", state_dir / f"rank{rank}.fr"


def ready_file(state_dir: Path, rank: int | str) -> Path:
    """Exists once the rank answers dump requests (it has an NCCL group)."""
    return state_dir / f"rank{rank}.fr-ready"


def serve(state_dir: str, rank: str) -> None:
    """Rank side: answer dump requests from a daemon thread."""

    request, out = _paths(Path(state_dir), rank)
    ready_file(Path(state_dir), rank).touch()

    def loop() -> None:
        with contextlib.suppress(Exception):
            dump()  # pay the first call's set-up now, not when a hang is being reported
        while True:
            time.sleep(0.5)
            if not request.exists():
                continue
            with contextlib.suppress(Exception):
                full = request.read_text() != STATUS
                request.unlink()
                out.write_bytes(dump(full))

    threading.Thread(target=loop, daemon=True, name="ddpkit-flight-recorder").start()


def dump(full: bool = True) -> bytes:
    """This process's flight-recorder dump (pickled), without per-collective stack traces,
    which are slow to symbolise and which the hang doctor takes from faulthandler instead.
    full=False leaves out the collectives too: the process groups' status alone, or the full
    dump where this torch's recorder keeps no such status (progress then comes from entries)."""
    from torch._C import _distributed_c10d as c10d

    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = bytes(fn(includeCollectives=full, includeStackTraces=False, onlyActive=False))
        except TypeError:  # an older signature
            return bytes(fn())
        if full or b"pg_status" in data:
            return data
        return dump(full=True)
    raise RuntimeError("this torch has no flight recorder dump")


def request(ranks: list[int], state_dir: Path, wait: float = 8.0) -> dict[int, Any]:
    """Launcher side: rank -> the unpickled dump, for the ranks that answered in time."""
    for rank in ranks:
        request_file, out = _paths(state_dir, rank)
        out.unlink(missing_ok=True)
        request_file.touch()
    dumps: dict[int, Any] = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and len(dumps) < len(ranks):
        time.sleep(0.1)
        for rank in ranks:
            out = _paths(state_dir, rank)[1]
            if rank not in dumps and out.exists():
                with contextlib.suppress(Exception):
                    dumps[rank] = pickle.loads(out.read_bytes())  # noqa: S301 - our own ranks
    return dumps


def summarize(dump: Any, last: int = 3) -> list[str]:
    """A few lines from one rank's dump: its last collectives, newest last."""
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    lines = []
    for e in entries[-last:]:
        op = str(e.get("profiling_name", "?")).replace("nccl:", "")
        lines.append(
            f"#{e.get('collective_seq_id', '?')} {op} {e.get('state', '?')} "
            f"in={e.get('input_sizes', '?')}"
        )
    return lines


def ask(state_dir: Path, rank: int) -> None:
    """Request the process groups' status without waiting (the hang watch reads it at its
    next sample)."""
    request_file, out = _paths(state_dir, rank)
    out.unlink(missing_ok=True)
    request_file.write_text(STATUS)


def answer(state_dir: Path, rank: int) -> Any | None:
    """The dump a rank wrote after `ask`, or None if it has not (yet)."""
    out = _paths(state_dir, rank)[1]
    try:
        return pickle.loads(out.read_bytes())  # noqa: S301 - written by our own rank
    except Exception:
        return None


def progress_state(dump: Any) -> tuple[int, Any]:
    """(completed collectives, what is pending or None): the completed count grows while the
    rank makes progress; the same pending value at two polls means it waits there. From the
    process groups' status when the dump has it, else from its entries."""
    status = dump.get("pg_status") if isinstance(dump, dict) else None
    if status:
        completed, waiting = 0, []
        for group, seqs in sorted(status.items(), key=lambda kv: str(kv[0])):
            done = int(seqs.get("last_completed_collective", -1))
            completed += max(done, 0)
            if int(seqs.get("last_enqueued_collective", -1)) > done:
                waiting.append((str(group), done + 1))
        return completed, tuple(waiting) or None
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    done = [int(e.get("collective_seq_id", -1)) for e in entries if e.get("state") == "completed"]
    waiting = [
        int(e.get("collective_seq_id", -1)) for e in entries if e.get("state") != "completed"
    ]
    return max(done, default=-1), min(waiting, default=None)


def pending(dump: Any) -> str | None:
    """The oldest collective this rank issued that has not completed, if any."""
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    for e in entries:
        if e.get("state") != "completed":
            op = str(e.get("profiling_name", "?")).replace("nccl:", "")
            return f"{op} #{e.get('collective_seq_id', '?')} ({e.get('state')})"
    return None
