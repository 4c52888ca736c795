"""`ddpkit doctor train.py`: the classic multi-GPU mistakes, found in a script's source.

It reads the source (AST, never runs it) and points at lines: DDP's device_ids given a global
rank, torch.distributed.launch in code (not in comments or docstrings), init without setting
the CUDA device (when the script uses CUDA), a hard-coded 'nccl', a --local_rank argument that
modern launchers never pass, a DataLoader under DDP without a DistributedSampler, a
DistributedSampler without set_epoch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from ddpkit.doctor.checks import Finding
from ddpkit.errors import ConfigError


def parse(path: str) -> tuple[str, ast.Module]:
    """The script's source and syntax tree; a clear error when it cannot be read or parsed."""
    try:
        source = Path(path).read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read {path}: {err.strerror}", fix="give the path of a training script"
        ) from None
    try:
        return source, ast.parse(source, filename=path)
    except SyntaxError as err:
        raise ConfigError(
            f"{path} is not valid Python (line {err.lineno}: {err.msg})",
            fix="fix the syntax error first",
        ) from None


def scan(
    path: str, gpus: int | None = None, parsed: tuple[str, ast.Module] | None = None
) -> list[Finding]:
    """Findings for the script at `path` (`parsed`: its `parse`, where the caller has it);
    `gpus` (this machine's) makes a hard-coded 'nccl' an error where there is none."""
    source, tree = parsed or parse(path)
    source_path = Path(path)
    name = source_path.name
    findings: list[Finding] = []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    text_of = {id(c): ast.unparse(c.func) for c in calls}

    def at(node: ast.AST) -> str:
        return f"{name}:{getattr(node, 'lineno', '?')}"

    for call in calls:
        func = text_of[id(call)]
        for kw in call.keywords:
            if kw.arg == "device_ids" and gpus == 0 and not _none(kw.value):
                findings.append(
                    Finding(
                        "error",
                        "script",
                        f"device_ids={ast.unparse(kw.value)} and this machine has no GPU",
                        "DistributedDataParallel takes device_ids only for a model on a GPU; "
                        "on the CPU it raises",
                        "pass `device_ids=[local_rank] if torch.cuda.is_available() else None` "
                        "with `local_rank = int(os.environ['LOCAL_RANK'])`, or s.wrap(model)",
                        at(call),
                    )
                )
            elif kw.arg == "device_ids" and _global_rank(kw.value):
                findings.append(
                    Finding(
                        "error",
                        "script",
                        f"device_ids={ast.unparse(kw.value)} uses the global rank",
                        "on the second node (or with CUDA_VISIBLE_DEVICES) the global rank "
                        "names a GPU that does not exist on this node",
                        "use the local rank (LOCAL_RANK), or `s.wrap(model)` with ddpkit",
                        at(call),
                    )
                )
        if func.endswith("cuda.set_device") and gpus == 0 and not _guarded(tree, call):
            findings.append(
                Finding(
                    "error",
                    "script",
                    f"{func}({', '.join(map(ast.unparse, call.args))}) and this machine has no GPU",
                    "there is no CUDA device to set: it raises (and `rank % "
                    "torch.cuda.device_count()` divides by 0)",
                    "set it only where there is one: `if torch.cuda.is_available(): "
                    "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))`, or ddpkit.setup()",
                    at(call),
                )
            )
        elif func.endswith("set_device") and call.args and _global_rank(call.args[0]):
            findings.append(
                Finding(
                    "warning",
                    "script",
                    f"set_device({ast.unparse(call.args[0])}) uses the global rank",
                    "rank % n happens to work on one node; LOCAL_RANK is what each node's "
                    "GPUs are numbered by",
                    "use int(os.environ['LOCAL_RANK']), or ddpkit.setup()",
                    at(call),
                )
            )
        if func.endswith("init_process_group") and _backend(call) == "nccl":
            here = gpus == 0
            findings.append(
                Finding(
                    "error" if here else "info",
                    "script",
                    "backend 'nccl' is hard-coded"
                    + (" and this machine has no GPU" if here else ""),
                    "init_process_group('nccl') fails here: NCCL needs a CUDA GPU per rank"
                    if here
                    else "the script cannot run on a machine without GPUs (a laptop, CI)",
                    "pick the backend from the machine: `backend='nccl' if "
                    "torch.cuda.is_available() else 'gloo'`, or use ddpkit.setup()",
                    at(call),
                )
            )
    if gpus == 0:
        findings += _cuda_devices(tree, at)
    findings += _module_of_wrapped(tree, source, at)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        launches = (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "torch.distributed.launch" in node.value
            and id(node) not in docstrings  # prose about it, as comments are
        ) or (
            isinstance(node, ast.Import | ast.ImportFrom)
            and any(
                "torch.distributed.launch" in f"{getattr(node, 'module', '') or ''}.{a.name}"
                for a in node.names
            )
        )
        if launches:
            findings.append(_launch_finding(at(node)))
    setters = ("set_device", "set_device_index")  # torch.cuda's and torch.accelerator's
    inits = [c for c in calls if text_of[id(c)].endswith("init_process_group")]
    uses_cuda = any(
        (isinstance(n, ast.Constant) and n.value in ("cuda", "nccl"))
        or (isinstance(n, ast.Attribute) and n.attr == "cuda")
        for n in ast.walk(tree)
    )
    on_cpu = any(_backend(c) == "gloo" for c in inits)
    if (
        inits
        and uses_cuda
        and not on_cpu
        and not any(text_of[id(c)].endswith(setters) for c in calls)
    ):
        findings.append(
            Finding(
                "warning",
                "script",
                "init_process_group is called but the CUDA device is never set",
                "every rank then uses GPU 0 (NCCL hangs or runs out of memory); NCCL needs "
                "the device set before init",
                "call torch.cuda.set_device(local_rank) before init, or use ddpkit.setup()",
                at(inits[0]),
            )
        )
    findings += _local_rank_argument(tree, source, at)
    ddp = [
        c
        for c in calls
        if text_of[id(c)].split(".")[-1] in ("DistributedDataParallel", "DDP")
        or (text_of[id(c)].endswith(".wrap") and "ddpkit" in source)  # s.wrap: DDP at N > 1
    ]
    samplers = [c for c in calls if text_of[id(c)].endswith("DistributedSampler")]
    loaders = [
        c
        for c in calls
        if text_of[id(c)].endswith("DataLoader") and not any(k.arg == "sampler" for k in c.keywords)
    ]
    # only a DataLoader without a sampler is a mistake: scripts that sample their own batches
    # per rank (nanoGPT's get_batch with a per-rank seed) have none to give
    if ddp and loaders and not samplers and ".loader(" not in source:
        findings.append(
            Finding(
                "warning",
                "script",
                "DistributedDataParallel without a DistributedSampler",
                "every rank trains on the whole data set: N copies of the same work",
                "pass sampler=DistributedSampler(dataset) to the DataLoader (and no "
                "shuffle=True: the sampler shuffles), or use s.loader(dataset, batch_size)",
                at(loaders[0]),
            )
        )
    from ddpkit.doctor import script_launch

    findings += script_launch.scan(tree, at)
    if samplers and not any(text_of[id(c)].endswith("set_epoch") for c in calls):
        findings.append(
            Finding(
                "warning",
                "script",
                "DistributedSampler without set_epoch",
                "every epoch sees the data in the same order",
                "call sampler.set_epoch(epoch) at the start of each epoch (s.loader() does)",
                at(samplers[0]),
            )
        )
    return findings


def _launch_finding(where: str) -> Finding:
    return Finding(
        "warning",
        "script",
        "torch.distributed.launch is deprecated",
        "it passes --local_rank as an argument and is slated for removal",
        "use `ddpkit run -n gpu train.py` (or torchrun)",
        where,
    )


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _backend(call: ast.Call) -> object:
    backend = (
        call.args[0]
        if call.args
        else next((k.value for k in call.keywords if k.arg == "backend"), None)
    )
    return backend.value if isinstance(backend, ast.Constant) else None


def _local_rank_argument(tree: ast.AST, source: str, at: Any) -> list[Finding]:
    """`parser.add_argument("--local_rank", default=-1)` and no read of LOCAL_RANK: torchrun
    and ddpkit run pass no such argument, so every rank keeps -1 and uses GPU 0."""
    if "LOCAL_RANK" in source:
        return []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("add_argument")
            and any(
                isinstance(a, ast.Constant) and a.value in ("--local_rank", "--local-rank")
                for a in node.args
            )
        ):
            return [
                Finding(
                    "error",
                    "script",
                    "the local rank comes from a --local_rank argument",
                    "torchrun and `ddpkit run` set LOCAL_RANK in the environment and pass no "
                    "such argument: it keeps its default, and every rank uses the same GPU",
                    "read int(os.environ['LOCAL_RANK']) (or ddpkit.setup()); or start it with "
                    "`ddpkit run --use-local-rank-arg`",
                    at(node),
                )
            ]
    return []


def _global_rank(node: ast.AST) -> bool:
    """An expression built from a name like rank / args.rank / dist.get_rank(), not local."""
    text = ast.unparse(node).lower()
    return "rank" in text and "local" not in text


def _none(node: ast.AST) -> bool:
    """`None`, or an expression that is None where there is no GPU (`[...] if
    torch.cuda.is_available() else None`)."""
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    return isinstance(node, ast.IfExp) and "is_available" in ast.unparse(node.test)


def _guarded(tree: ast.AST, call: ast.AST) -> bool:
    """The call sits under an `if` that asks whether CUDA is there."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp) and "is_available" in ast.unparse(node.test):
            body = node.body if isinstance(node, ast.If) else [node.body]
            if any(call in list(ast.walk(b)) for b in body):
                return True
    return False


def _cuda_devices(tree: ast.AST, at: Any) -> list[Finding]:
    """Work sent to CUDA unconditionally (`device = 'cuda'`, `.to('cuda')`, `.cuda()`,
    `torch.device('cuda')`), said once at its first place, on a machine with no GPU."""
    for node in ast.walk(tree):
        what = _cuda_named(node)
        if what is not None and not _guarded(tree, node):
            return [
                Finding(
                    "error",
                    "script",
                    f"the script sends work to CUDA ({what}) and this machine has no GPU",
                    "torch raises at the first tensor or model moved there ('Torch not compiled "
                    "with CUDA enabled', or no CUDA GPUs are available)",
                    "choose the device from the machine: `device = torch.device('cuda', "
                    "local_rank) if torch.cuda.is_available() else torch.device('cpu')`, and "
                    "`.to(device)` in place of .cuda(); or ddpkit.setup()'s s.device",
                    at(node),
                )
            ]
    return []


def _cuda_named(node: ast.AST) -> str | None:
    """How `node` names CUDA as a device, or None: 'cuda' (or 'cuda:0'), f'cuda:{rank}', a
    `.cuda()` call."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return f"'{node.value}'" if node.value.split(":")[0] == "cuda" else None
    if (
        isinstance(node, ast.JoinedStr)
        and node.values
        and isinstance(node.values[0], ast.Constant)
        and str(node.values[0].value).startswith("cuda")
    ):
        return ast.unparse(node)  # nanoGPT's f'cuda:{ddp_local_rank}'
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return ast.unparse(node) if node.func.attr == "cuda" else None
    return None


def _module_of_wrapped(tree: ast.AST, source: str, at: Any) -> list[Finding]:
    """`model.module` on what s.wrap returned: DDP's attribute, which a one-process job (where
    s.wrap gives back the model itself) does not have."""
    if "ddpkit" not in source:
        return []
    wrapped = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and ast.unparse(n.value.func).endswith(".wrap")
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "module"
            and isinstance(node.value, ast.Name)
            and node.value.id in wrapped
        ):
            return [
                Finding(
                    "warning",
                    "script",
                    f"{ast.unparse(node)} is DDP's attribute",
                    "with one process s.wrap gives back the model itself, which has no "
                    ".module: the script fails at world size 1",
                    f"use ddpkit.unwrap({node.value.id}) (the model inside DDP or FSDP, or "
                    "the model itself)",
                    at(node),
                )
            ]
    return []
