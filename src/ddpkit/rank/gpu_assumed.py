"""Fix lines for a script that assumes a GPU, run where none is visible (the classic guide's
script on a laptop or CI): each failure gets its fix the first time, with the place the value
came from, not only the line that failed.

* `rank % num_gpus` where `num_gpus = torch.cuda.device_count()` is 0 (ZeroDivisionError);
* `torch.cuda.set_device(...)` (a CPU build of torch has no `_cuda_setDevice`; a CUDA build
  says no GPU is available);
* a tensor or model sent to `device = 'cuda'` ("Torch not compiled with CUDA enabled");
* DDP given `device_ids` for a model on the CPU.

The value is followed through the script's own source (AST, never run): the name on the
failing line, then its assignment in the same function or module.
"""

from __future__ import annotations

import ast
import linecache
import os
from dataclasses import dataclass
from types import FrameType, TracebackType

from ddpkit.common.frames import is_library

NO_GPU_WORDS = (
    "Torch not compiled with CUDA enabled",
    "No CUDA GPUs are available",
    "Found no NVIDIA driver",
    "no attribute '_cuda_setDevice'",
    "no attribute '_cuda_getDeviceCount'",
)
DDP_CPU_WORDS = "device_ids and output_device arguments only work with single-device"
ON_ANY_MACHINE = (
    "one script for GPUs and CPUs: `device = torch.device('cuda', local_rank) if "
    "torch.cuda.is_available() else torch.device('cpu')`, or ddpkit.setup(), whose s.device "
    "and s.wrap do this"
)


@dataclass(frozen=True)
class Origin:
    """Where a value on the failing line came from: `name = text` at `site`."""

    name: str
    text: str
    site: str


def fix_for(error: BaseException, tb: TracebackType | None) -> str:
    """The fix for a GPU assumed where there is none, or ""."""
    frame, line = _script_frame(tb)
    message = str(error)
    if isinstance(error, ZeroDivisionError) and frame is not None:
        origin = _divisor_origin(frame, line)
        if origin is None:
            return ""
        came = f"{origin.name} = {origin.text} at {origin.site}" if origin.name else origin.text
        return (
            f"the divisor is 0: {came}, and no GPU is visible here (check CUDA_VISIBLE_DEVICES "
            "and nvidia-smi); on CPUs set no CUDA device (`if torch.cuda.is_available(): "
            "torch.cuda.set_device(local_rank)`, local_rank = int(os.environ['LOCAL_RANK'])), "
            "or use ddpkit.setup(), which picks the device from LOCAL_RANK"
        )
    if DDP_CPU_WORDS in message:
        return (
            "the model is on the CPU, so DistributedDataParallel takes no device_ids: pass "
            "`device_ids=[local_rank] if torch.cuda.is_available() else None`, or s.wrap(model)"
        )
    if not any(words in message for words in NO_GPU_WORDS):
        return ""
    source = _line(frame, line)
    if "set_device" in source or "_cuda_setDevice" in message:
        return (
            "no GPU is visible here, so there is no CUDA device to set: set it only where "
            "there is one (`if torch.cuda.is_available(): torch.cuda.set_device(local_rank)`), "
            "or use ddpkit.setup(), which sets it on GPUs and leaves it on CPUs"
        )
    origin = _cuda_origin(frame, line) if frame is not None else None
    where = f" ({origin.name} = {origin.text} at {origin.site})" if origin else ""
    return f"no GPU is visible here, and this line sends work to CUDA{where}: {ON_ANY_MACHINE}"


def _script_frame(tb: TracebackType | None) -> tuple[FrameType | None, int]:
    """The innermost frame of the user's own code, and its line."""
    found: tuple[FrameType | None, int] = (None, 0)
    while tb is not None:
        if not is_library(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _line(frame: FrameType | None, line: int) -> str:
    return linecache.getline(frame.f_code.co_filename, line) if frame is not None else ""


def _statement(frame: FrameType, line: int) -> ast.AST | None:
    tree = _tree(frame.f_code.co_filename)
    best = None
    for node in ast.walk(tree) if tree else ():
        if (
            isinstance(node, ast.stmt)
            and not isinstance(node, _SCOPES)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ):
            best = node  # the innermost statement holding the line
    return best


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While,
           ast.With, ast.Try)  # fmt: skip


def _tree(filename: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None


def _divisor_origin(frame: FrameType, line: int) -> Origin | None:
    """The zero divisor of `a % b` (or `//`, `/`) on the line, followed to device_count()."""
    statement = _statement(frame, line)
    if statement is None:
        return None
    for node in ast.walk(statement):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.FloorDiv | ast.Div):
            right = node.right
            if "device_count" in ast.unparse(right):
                return Origin("", ast.unparse(right) + " is 0", _site(frame, line))
            if isinstance(right, ast.Name) and frame.f_locals.get(
                right.id, frame.f_globals.get(right.id)
            ) in (0, 0.0):
                origin = _assignment(frame, right.id, line)
                if origin is not None and "device_count" in origin.text:
                    return origin
    return None


def _cuda_origin(frame: FrameType, line: int) -> Origin | None:
    """A name on the line whose assignment names CUDA (`device = 'cuda'`)."""
    statement = _statement(frame, line)
    if statement is None:
        return None
    for node in ast.walk(statement):
        if isinstance(node, ast.Name):
            origin = _assignment(frame, node.id, line)
            if origin is not None and "cuda" in origin.text:
                return origin
    return None


def _assignment(frame: FrameType, name: str, before: int) -> Origin | None:
    """The last `name = ...` before line `before`, in the function holding that line or at
    the module's top level."""
    tree = _tree(frame.f_code.co_filename)
    if tree is None:
        return None
    functions = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.lineno <= before <= (n.end_lineno or n.lineno)
    ]
    scope = list(ast.walk(functions[-1])) if functions else []
    found = None
    for node in [*tree.body, *scope]:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.lineno >= before:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if named and node.value is not None and (found is None or node.lineno > found[0]):
            found = (node.lineno, ast.unparse(node.value))
    if found is None:
        return None
    return Origin(name, found[1], _site(frame, found[0]))


def _site(frame: FrameType, line: int) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{line}"
