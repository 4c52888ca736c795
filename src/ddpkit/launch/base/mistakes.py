"""What users get wrong when they start a job, said before anything starts: the interpreter
given as the script (`ddpkit run -n 2 python train.py`), another launcher's flags
(Accelerate's `--num_processes`), rank variables left in the shell (`RANK=0,1,2`), misspelt
variables (`CUDA_VISIBLE_DIVICE`). No torch here."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddpkit.common.spelling import misspellings

# other launchers' flags, with ddpkit's (or torchrun's) way to say the same
OTHER_LAUNCHERS = {
    "--num_processes": "-n N (processes on this node)",
    "--num-processes": "-n N (processes on this node)",
    "--num_machines": "--nnodes N",
    "--machine_rank": "--node-rank K",
    "--main_process_ip": "--master-addr HOST",
    "--main_process_port": "--master-port PORT",
    "--multi_gpu": "-n gpu (one process per GPU)",
    "--gpus": "-n N",
    "--devices": "-n N",
}


def fix_for_option(word: str) -> str:
    name = word.split("=", 1)[0]
    if name in OTHER_LAUNCHERS:
        return (
            f"{name} is another launcher's flag (Accelerate, mpirun, Lightning); ddpkit run "
            f"says {OTHER_LAUNCHERS[name]}: see `ddpkit run --help`"
        )
    return "see `ddpkit run --help`; options go before the script name"


# ddpkit run's (and torchrun's) options that a training script has no use for: found after the
# script they would go to it, silently (torchrun passes them on too)
LAUNCHER_ONLY = frozenset(
    f"--{name}{sep}{rest}"
    for name, rest in (
        ("nproc", "per_node"),
        ("nnodes", ""),
        ("node", "rank"),
        ("master", "port"),
        ("master", "addr"),
        ("max", "restarts"),
        ("rdzv", "endpoint"),
        ("rdzv", "backend"),
        ("standalone", ""),
        ("hang", "timeout"),
        ("init", "timeout"),
    )  # fmt: skip
    for sep in (("_", "-") if rest else ("",))
)


def launcher_flags_after(script: str, rest: Sequence[str]) -> tuple[str, str] | None:
    """(what happened, the fix) when ddpkit run's own options come after the script, where
    they go to the script; None when there are none, or the script reads such an option
    itself (its source names it)."""
    moved: list[str] = []
    for i, word in enumerate(rest):
        name = word.split("=", 1)[0]
        if name in LAUNCHER_ONLY:
            takes_value = "=" not in word and name != "--standalone" and i + 1 < len(rest)
            moved += [word, rest[i + 1]] if takes_value else [word]
    if not moved:
        return None
    try:
        source = Path(script).read_text(errors="replace")
    except OSError:
        source = ""
    if any(w.split("=", 1)[0].lstrip("-") in source for w in moved if w.startswith("--")):
        return None  # the script's own option of that name
    left = list(rest)
    for word in moved:
        left.remove(word)
    shown = " ".join(moved)
    return (
        f"{shown} comes after the script {script}, so it would go to the script, not to ddpkit run",
        "put ddpkit run's options before the script: "
        f"`ddpkit run {shown} {' '.join([script, *left])}`",
    )


def is_python(word: str) -> bool:
    name = os.path.basename(word)
    return name in ("python", "python3") or (
        name.startswith("python3.") and name[len("python3.") :].isdigit()
    )


# what ddpkit run sets for each rank itself: a value in the launcher's own shell is replaced
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def environment_warnings(environ: Mapping[str, str]) -> list[str]:
    """What in the launcher's own environment will not do what the user meant: a rank variable
    ddpkit run replaces for every rank, a misspelt variable nothing reads."""
    lines = [
        f"{name}={environ[name]!r} is set in this shell; ddpkit run gives every rank its own "
        f"{name}, so this one is ignored (unset {name})"
        for name in RANK_VARIABLES
        if name in environ
    ]
    lines += [
        f"{name} is set and looks like a misspelling of {meant}: nothing reads it, so the "
        f"setting has no effect (export {meant}={environ[name]!r}; unset {name})"
        for name, meant in misspellings(environ)
    ]
    return lines


def rendezvous_warnings(
    environ: Mapping[str, str], master_addr: str, master_port: int
) -> list[str]:
    """MASTER_ADDR/MASTER_PORT exported in the launcher's shell that ddpkit run does not use
    (it gives every rank the job's own address; --master-addr/--master-port choose it)."""
    lines = []
    port = environ.get("MASTER_PORT", "").strip()
    if port and port != str(master_port):
        chosen = f"port {master_port}" if master_port else "a free port it picks"
        lines.append(
            f"MASTER_PORT={port} is set in this shell; ddpkit run gives every rank the job's "
            f"own ({chosen}), so this one is ignored (to use it: --master-port {port}; or "
            "unset MASTER_PORT)"
        )
    addr = environ.get("MASTER_ADDR", "").strip()
    loopback = {"localhost", "127.0.0.1", "::1"}
    if addr and addr != master_addr and not {addr, master_addr} <= loopback:
        lines.append(
            f"MASTER_ADDR={addr} is set in this shell; ddpkit run gives every rank "
            f"{master_addr}, so this one is ignored (for several nodes: --master-addr {addr})"
        )
    return lines
