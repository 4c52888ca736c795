"""The rank's side of the flight recorder: answer the launcher's dump requests.

PyTorch keeps a ring buffer of recent collectives per process group when TORCH_FR_BUFFER_SIZE
> 0 (ddpkit run sets 2000 unless set). `serve` registers the questions once the rank's process
group exists; the answering thread writes a dump when the launcher drops a request file.
Which recorder holds this group's entries depends on the torch build: a CUDA build keeps NCCL's
in `_dump_nccl_trace` and gloo's in `_dump_fr_trace`; a CPU build has only the latter. The dump
taken is the one that knows this process's groups.
"""

from __future__ import annotations

import functools
import pickle

from ddpkit.common import protocol
from ddpkit.rank import answering

RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")


def serve(state_dir: str, rank: str, backend: str) -> None:
    """Answer dump requests (ddpkit.rank.answering): full dumps and status polls, each in its
    own pair of files."""
    # the first dump's set-up is paid now, off the script's thread, not during a hang report
    first = functools.partial(dump, True, backend)
    for request, out, full in (
        (protocol.FLIGHT_REQUEST, protocol.FLIGHT_DUMP, True),
        (protocol.FLIGHT_STATUS_REQUEST, protocol.FLIGHT_STATUS_DUMP, False),
    ):
        make = functools.partial(dump, full, backend)
        answering.answer(state_dir, rank, request, out, make, first if full else None)
    protocol.state_path(state_dir, rank, protocol.FLIGHT_READY).touch()


def dump(full: bool = True, backend: str = "nccl") -> bytes:
    """This process's flight-recorder dump (pickled), without per-collective stack traces,
    which are slow to symbolise and which the hang doctor takes from faulthandler instead.
    full=False leaves out the collectives: the process groups' status alone, or the full dump
    where this torch's recorder keeps no such status (progress then comes from entries)."""
    from torch._C import _distributed_c10d as c10d

    order = RECORDERS[::-1] if backend == "nccl" else RECORDERS
    found = [getattr(c10d, name) for name in order if hasattr(c10d, name)]
    if not found:
        raise RuntimeError("this torch has no flight recorder dump")
    data = b""
    for fn in found:
        try:
            data = bytes(fn(includeCollectives=full, includeStackTraces=False, onlyActive=False))
        except TypeError:  # an older signature
            data = bytes(fn())
        content = pickle.loads(data)  # noqa: S301 - torch's own dump of this process
        if isinstance(content, dict) and (content.get("pg_status") or content.get("entries")):
            if full or content.get("pg_status"):
                return data
            return dump(True, backend)
    return data
