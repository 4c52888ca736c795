"""The out-of-memory verdict: from the figures the failing rank wrote as it ran out
(`ddpkit.rank.oom_facts`), what was asked, what the device held and where it went, and the fixes
that would fit, each with what it frees.

The arithmetic (an estimate, and it says so): the step's peak holds the model's state
(parameters, a gradient for every trainable parameter, the optimizer's state once it has
stepped) and its activations. The activations the step wanted are what was allocated beyond
the model's state when it failed, plus what it asked for; they are taken to grow with the
batch. The room for them is the device (or the process's cap) less the model's state, less
other processes' share, less a margin of 10%. A fix is offered only when what it frees covers
what is missing:

* a smaller micro-batch (the batch read from the failing forward's inputs), found by `s.fit`
  or kept as a global batch by `s.accumulate`;
* activation checkpointing of the model's repeated blocks (keeps about two blocks' worth);
* bf16 autocast for a model in float32 (activations at half the bytes);
* `zero_grad(set_to_none=True)` when gradients were held through the forward;
* `s.wrap(model, shard=True)` at N ranks (the model's state held as 1/N per rank).

When the rank's memory had grown step after step before it failed (the memory watch's leak
notice), the growth is the root cause and no fix that shrinks the step is offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpkit.common.protocol import OomFacts
from ddpkit.common.units import size

MARGIN = 0.10  # of the device's memory, kept free for workspaces and fragmentation
gib = size  # the name callers and tests knew


@dataclass(frozen=True)
class Fix:
    text: str  # what to do, with what it frees
    frees: int  # bytes it takes off the step's peak
    fits: bool  # it alone covers what is missing


@dataclass(frozen=True)
class Need:
    """The step's memory as the figures say."""

    model: int  # parameters, gradients and optimizer state at the step's peak
    activations: int  # what the step wanted beyond the model's state at this batch
    room: int  # what the device leaves for activations
    ceiling: int  # the device's memory, or the process's cap

    @property
    def missing(self) -> int:
        return self.activations - self.room


def grew_before(facts: OomFacts) -> str | None:
    """The rank's own words for a leak it saw in its last steps' memory (`grew` in its facts):
    '512 MiB a step, from 1.1 GiB to 6.2 GiB over 10 steps'."""
    grew = facts.get("grew")
    if not grew or len(grew) != 4 or grew[1] <= grew[0]:
        return None
    first, last, then, now = grew
    return (
        f"{size((now - then) / (last - first))} a step, from {size(then)} to {size(now)} over "
        f"{last - first} steps"
    )


def verdict(facts: OomFacts, rank: int, site: str, growth: str | None = None) -> tuple[str, str]:
    """(the root cause line, the fix line) for rank `rank` that ran out at `site`. `growth`:
    the memory watch's words when the rank's memory grew step after step before it failed."""
    kind = facts.get("kind", "cuda")
    where = f"GPU {facts.get('device', '?')}" if kind == "cuda" else "the host"
    at = f" at {site}" if site else ""
    asked = facts.get("asked")
    line = f"rank {rank} ran out of {'GPU' if kind == 'cuda' else 'host'} memory{at}"
    if growth:
        line += f" after its memory grew step after step ({growth})"
    if asked:
        line += f": asked for {size(asked)}"
    allowed = facts.get("allowed")
    ceiling = f", {size(allowed)} allowed to this process" if allowed else ""
    bound = facts.get("bound")
    if kind != "cuda" and bound and facts.get("bound_kind", "machine") != "machine":
        where = f"the host's {bound.removeprefix('the ')}"
    held = [f"{where} ({size(facts.get('total'))}{ceiling})"]
    if kind == "cuda":
        held.append(
            f"torch {size(facts.get('allocated'))} allocated "
            f"({size(facts.get('reserved'))} reserved)"
        )
        if facts.get("others") is not None:
            held.append(f"other processes {size(facts.get('others'))}")
    else:
        held.append(f"the rank's process {size(facts.get('allocated'))}")
    held.append(f"free {size(facts.get('free'))}")
    line += "; " + ", ".join(held)
    split = _split(facts)
    if split:
        rest = "activations, workspaces" if kind == "cuda" else "libraries, activations"
        line += (
            f"; of it parameters {size(split['params'])}, gradients {size(split['grads'])}, "
            f"optimizer state {size(split['optimizer'])}, the rest ({rest}) {size(split['rest'])}"
        )
    return line, fix_line(facts, site, growth)


def fix_line(facts: OomFacts, site: str = "", growth: str | None = None) -> str:
    """The fixes that fit, each with what it frees; or why none does."""
    at = f" at {site.split(' in ')[0]}" if site else ""
    if growth:
        return (
            "find what keeps memory every step: a loss or output kept for logging without "
            ".item(), a list that grows, an evaluation outside torch.no_grad(), a graph kept by "
            "retain_graph (`ddpkit run --memory-snapshot` records who allocates); a smaller "
            "batch only delays the failure"
        )
    asked, total = facts.get("asked"), facts.get("allowed") or facts.get("total")
    if asked and total and asked > total:
        if facts.get("kind") == "cuda":
            label = "this process's cap on the GPU" if facts.get("allowed") else "the GPU's memory"
        else:
            bound = str(facts.get("bound") or "the machine")
            machine = facts.get("bound_kind", "machine") == "machine"
            label = "the machine's memory" if machine else bound
        limited = facts.get("kind") != "cuda" and facts.get("bound_kind") == "address_space"
        why = "raise the limit (ulimit -v) if the size is right; " if limited else ""
        return (
            f"one allocation of {size(asked)} is more than {label} ({size(total)}) in all: no "
            f"batch size or setting makes it fit; {why}check the size computed{at} (a shape "
            "taken from the wrong variable, a wrong dtype, a size that grows without bound)"
        )
    need = needs(facts)
    if need is None:
        return "use a smaller batch per rank (the figures to size it were not readable)"
    if need.missing <= 0:
        return (
            f"by these figures the step fits ({size(need.activations)} of activations in "
            f"{size(need.room)} of room): memory is fragmented or another process took it; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets torch reuse freed memory"
        )
    found = fixes(facts)
    fitting = [f for f in found if f.fits]
    if fitting:
        return "; or ".join(f.text for f in fitting)
    missing = f"{size(need.missing)} missing ({size(need.activations)} of activations wanted, "
    missing += f"{size(max(0, need.room))} of room after the model's {size(need.model)})"
    if not found:
        return f"no change ddpkit can size frees the {missing}: use a larger device"
    together = sum(f.frees for f in found) >= need.missing
    return (
        f"no single change frees the {missing}; "
        + ("together: " if together else "even all of these together fall short: ")
        + "; ".join(f.text for f in found)
    )


def _split(facts: OomFacts) -> dict[str, int] | None:
    allocated = facts.get("allocated")
    if allocated is None:
        return None
    params = int(facts.get("params") or 0)
    grads = int(facts.get("grads") or 0)
    optimizer = int(facts.get("optimizer") or 0)
    rest = max(0, int(allocated) - params - grads - optimizer)
    return {"params": params, "grads": grads, "optimizer": optimizer, "rest": rest}


def _model_state(facts: OomFacts, split: dict[str, int]) -> int:
    """Parameters, gradients and optimizer state at the step's peak: a gradient for every
    trainable parameter, and the optimizer's state once it has stepped (Adam makes its state
    at its first step, so an OOM in the first forward shows none)."""
    grads = max(split["grads"], int(facts.get("grads_expected") or 0))
    if "grads_expected" not in facts:  # figures from before the expected sizes were written
        grads = split["grads"] or (split["params"] if split["optimizer"] else 0)
    optimizer = max(split["optimizer"], int(facts.get("optimizer_expected") or 0))
    return split["params"] + grads + optimizer


def needs(facts: OomFacts) -> Need | None:
    split, total = _split(facts), facts.get("total")
    if not split or not total:
        return None
    model = _model_state(facts, split)
    others = 0 if facts.get("allowed") else int(facts.get("others") or 0)
    ceiling = int(facts.get("allowed") or total)
    room = int(ceiling * (1 - MARGIN)) - model - others
    wanted = split["rest"] + int(facts.get("asked") or 0)
    return Need(model, wanted, room, ceiling)


def fit_micro_batch(facts: OomFacts) -> int | None:
    """The largest power-of-two fraction of the batch whose activations fit (an estimate)."""
    need, batch = needs(facts), facts.get("batch")
    if need is None or not batch or batch < 2 or need.room <= 0 or need.activations <= 0:
        return None
    per_sample = need.activations / batch
    micro = batch
    while micro > 1 and micro * per_sample > need.room:
        micro //= 2
    return micro if micro < batch and micro * per_sample <= need.room else None


def fixes(facts: OomFacts) -> list[Fix]:
    """Every fix ddpkit can size for these figures, with what it frees, largest first."""
    need = needs(facts)
    if need is None:
        return []
    found: list[Fix] = []
    missing = need.missing
    batch = facts.get("batch")
    if batch and batch >= 2 and need.activations > 0:
        per_sample = need.activations / batch
        micro = fit_micro_batch(facts) or batch // 2
        frees = int((batch - micro) * per_sample)
        steps = math.ceil(batch / micro)
        read = "the failing forward's" if facts.get("batch_from") == "forward" else "the loader's"
        found.append(
            Fix(
                f"micro-batches of {micro} instead of {batch} free about {size(frees)} "
                f"({size(per_sample)} of activations per sample, {read} batch of {batch}): "
                f"s.fit(...) finds the size every rank can run, or s.accumulate(model, "
                f"every={steps}) keeps the batch of {batch} per rank",
                frees,
                frees >= missing,
            )
        )
    if facts.get("kind") == "cuda":
        layers = int(facts.get("blocks") or 0)
        if layers >= 4 and facts.get("phase") in ("forward", "backward"):
            frees = int(need.activations * (1 - 2 / layers))
            found.append(
                Fix(
                    f"activation checkpointing of the model's {layers} blocks "
                    f"(torch.utils.checkpoint.checkpoint around each) frees about {size(frees)}, "
                    "for about a third more compute",
                    frees,
                    frees >= missing,
                )
            )
        if facts.get("fp32"):
            frees = need.activations // 2
            found.append(
                Fix(
                    f"bf16 autocast (torch.autocast('cuda', dtype=torch.bfloat16) around the "
                    f"forward and the loss) frees about {size(frees)}, half the activations, "
                    "if the step does not run under autocast already",
                    frees,
                    frees >= missing,
                )
            )
        grads = int(facts.get("grads") or 0)
        if grads and facts.get("phase") == "forward":
            found.append(
                Fix(
                    f"optimizer.zero_grad(set_to_none=True) before the forward frees the "
                    f"{size(grads)} of gradients held through it",
                    grads,
                    grads >= missing,
                )
            )
        found.extend(_sharding(facts, need))
    return sorted(found, key=lambda f: -f.frees)


def _sharding(facts: OomFacts, need: Need) -> list[Fix]:
    world = int(facts.get("world_size") or 1)
    if need.model <= 0:
        return []
    if world > 1:
        frees = need.model - need.model // world
        return [
            Fix(
                f"s.wrap(model, shard=True) frees about {size(frees)} per rank: parameters, "
                f"gradients and optimizer state of {size(need.model)} held as "
                f"{size(need.model / world)} per rank at world size {world}",
                frees,
                frees >= need.missing,
            )
        ]
    for gpus in (2, 4, 8):
        frees = need.model - need.model // gpus
        if frees >= need.missing:
            return [
                Fix(
                    f"on {gpus} GPUs s.wrap(model, shard=True) frees about {size(frees)} per "
                    f"GPU: the model's state of {size(need.model)} held as "
                    f"{size(need.model / gpus)} per GPU",
                    frees,
                    True,
                )
            ]
    return []
