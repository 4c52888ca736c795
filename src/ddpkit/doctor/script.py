"""`ddpkit doctor train.py`: the classic multi-GPU mistakes, found in a script's source.

It reads the source (AST, never runs it) and points at lines: DDP's device_ids given a global
rank, torch.distributed.launch, init without set_device, a hard-coded 'nccl', DDP without a
DistributedSampler, a DistributedSampler without set_epoch.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ddpkit.doctor.checks import Finding
from ddpkit.errors import ConfigError


def scan(path: str) -> list[Finding]:
    source_path = Path(path)
    try:
        source = source_path.read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read {path}: {err.strerror}", fix="give the path of a training script"
        ) from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        raise ConfigError(
            f"{path} is not valid Python (line {err.lineno}: {err.msg})",
            fix="fix the syntax error first",
        ) from None
    name = source_path.name
    findings: list[Finding] = []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    text_of = {id(c): ast.unparse(c.func) for c in calls}

    def at(node: ast.AST) -> str:
        return f"{name}:{getattr(node, 'lineno', '?')}"

    for call in calls:
        func = text_of[id(call)]
        for kw in call.keywords:
            if kw.arg == "device_ids" and _global_rank(kw.value):
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
        if func.endswith("set_device") and call.args and _global_rank(call.args[0]):
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
        if func.endswith("init_process_group"):
            backend = (
                call.args[0]
                if call.args
                else next((k.value for k in call.keywords if k.arg == "backend"), None)
            )
            if isinstance(backend, ast.Constant) and backend.value == "nccl":
                findings.append(
                    Finding(
                        "info",
                        "script",
                        "backend 'nccl' is hard-coded",
                        "the script cannot run on a machine without GPUs (a laptop, CI)",
                        "pick the backend from the machine, or use ddpkit.setup()",
                        at(call),
                    )
                )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "torch.distributed.launch" in node.value
        ):
            findings.append(_launch_finding(at(node)))
    for lineno, line in enumerate(source.splitlines(), 1):
        if "torch.distributed.launch" in line and line.lstrip().startswith("#"):
            findings.append(_launch_finding(f"{name}:{lineno}"))
    inits = [c for c in calls if text_of[id(c)].endswith("init_process_group")]
    if inits and not any(text_of[id(c)].endswith("set_device") for c in calls):
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
    ddp = [c for c in calls if text_of[id(c)].split(".")[-1] in ("DistributedDataParallel", "DDP")]
    samplers = [c for c in calls if text_of[id(c)].endswith("DistributedSampler")]
    if ddp and not samplers and "loader(" not in source:
        findings.append(
            Finding(
                "warning",
                "script",
                "DistributedDataParallel without a DistributedSampler",
                "every rank trains on the whole data set: N copies of the same work",
                "pass sampler=DistributedSampler(dataset) to the DataLoader, or use s.loader()",
                at(ddp[0]),
            )
        )
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


def _global_rank(node: ast.AST) -> bool:
    """An expression built from a name like rank / args.rank / dist.get_rank(), not local."""
    text = ast.unparse(node).lower()
    return "rank" in text and "local" not in text
