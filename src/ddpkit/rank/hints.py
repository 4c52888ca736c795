"""A fix line for the torch errors a user can fix, worked out in the rank that raised them (where
the model and the machine can still be asked): the bootstrap writes it into the rank's error
record, and the launcher's report prints it under the root cause.

* nccl asked for where it cannot run (no GPU, a CPU build of torch);
* a GPU assumed where none is visible (`rank % num_gpus`, set_device, device='cuda', DDP's
  device_ids): ddpkit.rank.gpu_assumed;
* `model.module` at world size 1, where s.wrap gives back the model itself;
* a CUDA device-side assert, which surfaces at a later line than its cause;
* DDP's unused parameters, named (torch gives their indices) with `find_unused_parameters=True`;
* a model that differs on one rank (DDP's shape check), with the parameter named;
* a debugger on a rank that has no terminal (BdbQuit: `--stdin N`);
* a port already in use (EADDRINUSE), with the process that holds it and how to let the
  launcher choose one.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import re
import sys
from types import TracebackType
from typing import Any

from ddpkit.rank import gpu_assumed

_PORT = re.compile(r"port:? (\d+)")
_UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_MISMATCH = re.compile(r"\[(\d+)\]: params\[(\d+)\] in this process with sizes (\[[\d, ]*\])")


def fix_for(error: BaseException, tb: TracebackType | None) -> str:
    """What the user can do about `error`, or "" when ddpkit has nothing better than torch's
    own words."""
    try:
        return _fix_for(error, tb)
    except Exception:  # a hint must never hide the error it is about
        return ""


def _fix_for(error: BaseException, tb: TracebackType | None) -> str:
    message = str(error)
    if "NCCL built in" in message or "ProcessGroupNCCL is only supported with GPUs" in message:
        return (
            "this machine has no CUDA GPU for NCCL (or this torch build has no NCCL): use "
            "backend='gloo' on CPUs, or ddpkit.setup(), which picks nccl or gloo by itself"
        )
    if "device-side assert" in message:
        return (
            "a CUDA kernel's own check failed (a device-side assert), and CUDA reports it late: "
            "the line named is where the error surfaced (the next call that waits for the GPU: "
            ".item(), .cpu(), print, a collective), not where it happened. Such an assert is "
            "almost always an index out of range: token ids at or past an nn.Embedding's "
            "num_embeddings, cross_entropy targets outside 0..classes-1 (other than its "
            "ignore_index), gather/index_select/scatter indices; the real line: rerun with "
            "CUDA_LAUNCH_BLOCKING=1 (`CUDA_LAUNCH_BLOCKING=1 ddpkit run ...`), or run a step on "
            "the CPU, where the same mistake is an IndexError at its own line"
        )
    no_gpu = gpu_assumed.fix_for(error, tb)
    if no_gpu:
        return no_gpu
    if isinstance(error, AttributeError) and str(error).endswith("has no attribute 'module'"):
        return (
            "`model.module` is DDP's: with one process s.wrap (and ddpkit.setup) leave the "
            "model as it is, so there is no .module; use ddpkit.unwrap(model), which is the "
            "model inside DDP or FSDP and the model itself otherwise, at any world size"
        )
    if type(error).__name__ == "BdbQuit" and os.environ.get("_DDPKIT_STATE_DIR"):
        rank = os.environ.get("RANK", "0")
        return (
            f"a debugger (breakpoint(), pdb) on rank {rank} found no terminal to read: ddpkit "
            "run gives the terminal to one rank (rank 0 by default, when it is a terminal); "
            f"rerun with --stdin {rank} to debug rank {rank} at its prompt (the hang watch "
            "leaves a rank at a prompt alone)"
        )
    if "EADDRINUSE" in message or "ddress already in use" in message:
        said = _PORT.search(message)
        # torch before 2.5 (libuv's words) names no port: the failing call's own argument
        port = int(said.group(1)) if said else _port_of_call(tb)
        if port:
            from ddpkit.common.procs import port_taken_fix

            return port_taken_fix(port)
        return (
            "a port the script listens on is taken: let ddpkit run choose the job's port (no "
            "MASTER_PORT of the script's own), or give that listener a free port (0: the "
            "system picks one)"
        )
    unused = _UNUSED.search(message)
    if unused:
        indices = [int(i) for i in unused.group(2).split()]
        names = _parameter_names(tb, indices)
        which = f" ({', '.join(names)})" if names else ""
        return (
            f"parameters {' '.join(map(str, indices))}{which} got no gradient on rank "
            f"{unused.group(1)}: let every output that holds them reach the loss, or wrap with "
            "find_unused_parameters=True (s.wrap(model, find_unused_parameters=True), or "
            "DistributedDataParallel(..., find_unused_parameters=True))"
        )
    mismatch = _MISMATCH.search(message)
    if mismatch:
        rank, index, sizes = mismatch.groups()
        names = _parameter_names(tb, [int(index)])
        which = f" ({names[0]})" if names else ""
        return (
            f"rank {rank} built a different model: its parameter {index}{which} has sizes "
            f"{sizes}, unlike rank 0's; build the model the same way on every rank (the same "
            "code path and configuration, nothing that depends on the rank)"
        )
    return ""


def _parameter_names(tb: TracebackType | None, indices: list[int]) -> list[str]:
    """Names of DDP's parameters by index (DDP counts the parameters that require grad, in
    named_parameters() order), from the DistributedDataParallel in the failing call."""
    ddp = _ddp_in(tb)
    if ddp is None:
        return []
    module = getattr(ddp, "module", ddp)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return [names[i] for i in indices if 0 <= i < len(names)]


def _ddp_in(tb: TracebackType | None) -> Any:
    """The DistributedDataParallel whose method is in the traceback, if any."""
    ddp_type = getattr(
        sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None
    )
    if ddp_type is None:
        return None
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, ddp_type):
            found = candidate
        tb = tb.tb_next
    return found


def _port_of_call(tb: TracebackType | None) -> int | None:
    """The port the failing call was given: a local `port` or `master_port` of the innermost
    frame that has one (torch's store creation), else the port argument of a TCPStore call
    on the innermost line that makes one (the script's own store), where it is a plain
    expression (a number, a name, `sys.argv[1]`, `int(...)` of those)."""
    found = None
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        names = tb.tb_frame.f_locals
        for name in ("port", "master_port"):
            value = _as_port(names.get(name))
            if value is not None:
                found = value
        tb = tb.tb_next
    if found is not None:
        return found
    for frame, line in reversed(frames):
        call = _store_call(frame.f_code.co_filename, line)
        if call is not None:
            given = call.args[1] if len(call.args) > 1 else None
            given = next((k.value for k in call.keywords if k.arg == "port"), given)
            if given is not None:
                return _as_port(_plain_value(given, frame.f_globals, frame.f_locals))
    return None


def _as_port(value: object) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and 0 < value < 65536 else None


def _store_call(filename: str, line: int) -> ast.Call | None:
    """The `...TCPStore(...)` call that starts on `line` of `filename`, if any."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node, "lineno", 0) <= line <= (
            getattr(node, "end_lineno", 0) or 0
        ):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            name = node.func.id if isinstance(node.func, ast.Name) else name
            if name == "TCPStore":
                return node
    return None


def _plain_value(node: ast.expr, globals_: dict[str, Any], locals_: dict[str, Any]) -> object:
    """The value of a plain expression (a constant, a name, a subscript or attribute of those,
    int()/str() of one), read from the frame; None for anything else (never run code)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return locals_.get(node.id, globals_.get(node.id))
    if isinstance(node, ast.Attribute):
        owner = _plain_value(node.value, globals_, locals_)
        return getattr(owner, node.attr, None) if isinstance(owner, type(sys)) else None
    if isinstance(node, ast.Subscript):
        seq, key = (
            _plain_value(node.value, globals_, locals_),
            _plain_value(node.slice, globals_, locals_),
        )
        if isinstance(seq, (list, tuple, dict)) and isinstance(key, (int, str)):
            try:
                return seq[key]  # type: ignore[index]
            except (IndexError, KeyError, TypeError):
                return None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("int", "str")
        and len(node.args) == 1
        and not node.keywords
    ):
        inner = _plain_value(node.args[0], globals_, locals_)
        with contextlib.suppress(ValueError, TypeError):
            return int(inner) if node.func.id == "int" else str(inner)  # type: ignore[call-overload]
    return None
