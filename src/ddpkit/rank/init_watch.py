"""What the rank does around `init_process_group` and its collectives, installed by the
bootstrap as torch.distributed is imported: rank 0 of a one-node job serves the job's store on
the launcher's socket; the rank's phase (init, ready) is told to the launcher; the arguments
and variables the script gives init are checked against what `ddpkit run` gave
(`ddpkit.rank.init_args`); each collective's start and end go into the progress record.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import types
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ddpkit.common import protocol
from ddpkit.common.frames import is_library
from ddpkit.rank import runtime
from ddpkit.rank.steps import waited_in_collective


def set_phase(phase: str) -> None:
    from ddpkit.rank.progress import set_phase as tell

    tell(phase)


@dataclass
class ServedStore:
    """The job's TCPStore, when this rank serves it (kept to the end): a runtime part."""

    server: Any = None


def serve_store() -> None:
    """Rank 0 of a one-node job: serve the job's store on the launcher's listening socket, as
    soon as torch.distributed is imported (the peers' connections wait in its backlog till
    then). init_process_group and ddpkit.setup() find it by its port (multi-tenant)."""
    served = runtime.current().part(ServedStore)
    fd = os.environ.pop(protocol.STORE_FD, None)
    if fd is None or served.server is not None:
        return
    from ddpkit.common.store_server import serve_fd
    from ddpkit.rank.init_args import LAUNCHER

    # the launcher's port, even where the script has set its own before importing torch
    port = int(LAUNCHER.get("MASTER_PORT") or os.environ.get("MASTER_PORT", "0"))
    timeout = float(os.environ.get(protocol.INIT_TIMEOUT, "330"))
    try:
        served.server = serve_fd(int(fd), "127.0.0.1", port, timeout, multi_tenant=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(int(fd))


def patch_init(module: ModuleType) -> None:
    """Serve the job's store (rank 0 of one node); mark when this rank enters and leaves
    init_process_group; record its collectives."""
    try:
        serve_store()
    except Exception as err:  # the peers then time out at init, and the report says why
        from ddpkit.errors import debug_note

        debug_note("serving the job's store", err)
    original = module.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if runtime.current().is_rank():  # the rank, not its child
            from ddpkit.rank import init_args

            checked = init_args.check(
                original, args, kwargs, init_args.script_site(sys._getframe(1))
            )
            args, kwargs = checked.args, checked.kwargs
            if checked.notes and runtime.current().rank_name == "0":  # said once for the job
                print(
                    f"ddpkit: {init_args.replaced_line(checked.notes)}", file=sys.stderr, flush=True
                )
        set_phase("init")
        result = original(*args, **kwargs)
        set_phase("ready")
        if runtime.current().state_dir:
            timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
            record_group(str(module.get_backend()), timeout)
            from ddpkit.rank import oom_facts

            oom_facts.start_history()  # --memory-snapshot: the allocator's events, from here on
        if runtime.current().state_dir and _recording():
            from ddpkit.rank import flight_answers

            flight_answers.serve(
                runtime.current().state_dir, runtime.current().rank_name, str(module.get_backend())
            )
        return result

    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    track_collectives(module)


def record_group(backend: str, timeout: Any) -> None:
    """The group's backend and collective timeout, for the launcher's long-wait note."""
    if timeout is None:
        from torch.distributed import constants

        default = constants.default_pg_timeout
        if backend == "nccl":
            default = getattr(constants, "default_pg_nccl_timeout", None) or default
        timeout = default
    try:
        protocol.write_group(
            runtime.current().state_dir,
            runtime.current().rank_name,
            backend,
            float(timeout.total_seconds()),
        )
    except (OSError, AttributeError):
        pass


def _recording() -> bool:
    """The flight recorder keeps entries (the launcher sets its buffer unless told not to)."""
    if os.environ.get(protocol.TRACK) == "0":
        return False
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    return bool(size and size.strip().isdigit() and int(size) > 0)


def track_collectives(module: ModuleType) -> None:
    """Record each collective's start and end in this rank's progress record."""
    from ddpkit.rank import progress

    record = progress.writer()
    if record is None or os.environ.get(protocol.TRACK) == "0":
        return

    depth = [0]  # a collective inside another (torch's own, a wrapper's): not recorded again

    def wrap(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(*args, **kwargs)
            site, shapes = user_site(), describe_shapes(args)
            depth[0] += 1
            record.enter(name, shapes, site)
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                record.leave(name, shapes, site)
                waited_in_collective(time.perf_counter() - began)

        collective._ddpkit_original = original  # type: ignore[attr-defined]  # ddpkit's own calls
        return collective

    for name in protocol.COLLECTIVES:
        original = getattr(module, name, None)
        if callable(original):
            setattr(module, name, wrap(name, original))


def user_site() -> str:
    """file:line (function) of the innermost caller outside torch and ddpkit."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def describe_shapes(args: tuple[Any, ...]) -> str:
    shapes = []
    for arg in args[:2]:
        items = arg if isinstance(arg, list | tuple) else [arg]
        for item in items[:2]:
            shape = getattr(item, "shape", None)
            if shape is not None:
                shapes.append(str(list(shape)))
    return " ".join(shapes)
