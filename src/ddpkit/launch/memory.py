"""The out-of-memory verdict: from the figures the failing rank wrote as it ran out
(`ddpkit.rank.memory`), what was asked, what the device held and where it went, and fixes
computed for this job: the micro-batch (with `s.accumulate`) that keeps the batch, and what
`s.wrap(model, shard=True)` would hold per rank at this world size.

How the micro-batch is computed: the rest of the allocated memory (activations, workspaces)
is taken to grow with the batch; what the device can give to it is its total, less the model's
parameters, gradients and optimizer state, less other processes' share, less a margin of 10%.
The micro-batch is the largest power-of-two fraction of the batch whose share of the rest
fits. It is an estimate, and says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ddpkit.common import protocol

MARGIN = 0.10  # of the device's memory, kept free for workspaces and fragmentation


def read(state_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        found = json.loads(protocol.state_path(state_dir, rank, protocol.MEMORY).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def gib(n: float | None) -> str:
    """Bytes as GiB (MiB below one GiB)."""
    if n is None:
        return "?"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def verdict(facts: dict[str, Any], rank: int, site: str) -> tuple[str, str]:
    """(the root cause line, the fix line) for rank `rank` that ran out at `site`."""
    kind = facts.get("kind", "cuda")
    where = f"GPU {facts.get('device', '?')}" if kind == "cuda" else "the host"
    at = f" at {site}" if site else ""
    asked = facts.get("asked")
    line = f"rank {rank} ran out of {'GPU' if kind == 'cuda' else 'host'} memory{at}"
    if asked:
        line += f": asked for {gib(asked)}"
    allowed = facts.get("allowed")
    ceiling = f", {gib(allowed)} allowed to this process" if allowed else ""
    held = [f"{where} ({gib(facts.get('total'))}{ceiling})"]
    if kind == "cuda":
        held.append(
            f"torch {gib(facts.get('allocated'))} allocated ({gib(facts.get('reserved'))} reserved)"
        )
        if facts.get("others") is not None:
            held.append(f"other processes {gib(facts.get('others'))}")
    else:
        held.append(f"the rank's process {gib(facts.get('allocated'))}")
    held.append(f"free {gib(facts.get('free'))}")
    line += "; " + ", ".join(held)
    split = _split(facts)
    if split:
        rest = "activations, workspaces" if kind == "cuda" else "libraries, activations"
        line += (
            f"; of it parameters {gib(split['params'])}, gradients {gib(split['grads'])}, "
            f"optimizer state {gib(split['optimizer'])}, the rest ({rest}) {gib(split['rest'])}"
        )
    return line, "; or ".join(fixes(facts)) or "use a smaller batch per rank"


def _split(facts: dict[str, Any]) -> dict[str, int] | None:
    allocated = facts.get("allocated")
    if allocated is None:
        return None
    params, grads, optimizer = (int(facts.get(k) or 0) for k in ("params", "grads", "optimizer"))
    rest = max(0, int(allocated) - params - grads - optimizer)
    return {"params": params, "grads": grads, "optimizer": optimizer, "rest": rest}


def _model_state(split: dict[str, int]) -> int:
    """Parameters, gradients and optimizer state at the step's peak. Gradients freed when the
    rank failed (zero_grad(set_to_none=True) before the forward) come back in the backward, so
    a model with optimizer state is taken to hold its parameters' size again in gradients."""
    grads = split["grads"] or (split["params"] if split["optimizer"] else 0)
    return split["params"] + grads + split["optimizer"]


def fit_micro_batch(facts: dict[str, Any]) -> int | None:
    """The largest power-of-two fraction of the batch whose activations fit (an estimate)."""
    split = _split(facts)
    batch, total = facts.get("batch"), facts.get("total")
    if not split or not batch or not total or batch < 2:
        return None
    model = _model_state(split)
    others = int(facts.get("others") or 0)
    ceiling = facts.get("allowed") or total
    room = ceiling * (1 - MARGIN) - model - (0 if facts.get("allowed") else others)
    needed = split["rest"] + int(facts.get("asked") or 0)  # what the step wanted at this batch
    if room <= 0 or needed <= 0:
        return None
    per_sample = needed / batch
    micro = batch
    while micro > 1 and micro * per_sample > room:
        micro //= 2
    return micro if micro < batch and micro * per_sample <= room else None


def fixes(facts: dict[str, Any]) -> list[str]:
    """What would fit, computed from the figures."""
    found = []
    batch = facts.get("batch")
    micro = fit_micro_batch(facts)
    if micro and batch:
        steps = math.ceil(batch / micro)
        found.append(
            f"micro-batches of {micro} with s.accumulate(model, every={steps}) keep the batch "
            f"of {batch} per rank (an estimate: the activations taken to grow with the batch)"
        )
    split = _split(facts)
    world = int(facts.get("world_size") or 1)
    model = _model_state(split) if split else 0
    if not model or facts.get("kind") != "cuda":
        return found
    if world > 1:
        found.append(
            f"s.wrap(model, shard=True) holds parameters, gradients and optimizer state of "
            f"{gib(model / world)} per rank at world size {world} instead of {gib(model)}"
        )
    else:
        found.append(
            f"on N GPUs s.wrap(model, shard=True) holds the model's {gib(model)} as "
            f"{gib(model)}/N per GPU"
        )
    return found
