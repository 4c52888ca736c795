"""The collectives `ddpkit bench` times: sizes and counts, bus-bandwidth factors, the torch call
behind each placement, and inputs whose exact result is known whatever the reduction order.

Sizes and counts follow nccl-tests: all_gather, reduce_scatter and alltoall count elements per
rank, rounded down to 16 bytes; the others count the whole buffer. busbw = algbw x factor:
2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and alltoall, 1 otherwise.

torch has no out-of-place all_reduce, broadcast or reduce (its functional collectives copy,
then reduce in place), so their out-of-place column times exactly that: a copy into the output,
then the in-place collective. all_gather, reduce_scatter, alltoall and sendrecv are natively
out-of-place. In-place alltoall and sendrecv are timed like nccl-tests' but not checked (N/A).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
REDUCE_OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG"}
PER_RANK = ("all_gather", "reduce_scatter", "alltoall")


def counts(collective: str, size: int, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(count shown in the table, size shown in bytes) for a requested size."""
    item = torch.empty((), dtype=dtype).element_size()
    if collective in PER_RANK:
        align = max(1, 16 // item)
        per_rank = size // item // n // align * align
        return per_rank, per_rank * n * item
    count = size // item
    return count, count * item


def bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in PER_RANK:
        return (n - 1) / n
    return 1.0


def uses_op(collective: str) -> bool:
    return collective in ("all_reduce", "reduce_scatter", "reduce")


def uses_root(collective: str) -> bool:
    return collective in ("broadcast", "reduce")


@dataclass
class Case:
    """One placement of one size: `run` issues the collective, `reset` restores the inputs,
    `wrong` counts elements that differ from the exact result (None: not checked)."""

    run: Callable[[], Any]
    reset: Callable[[], Any]
    wrong: Callable[[], int | None]


def _values(kind: str, idx: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Rank r's inputs: small integers, so every sum, product, max and min is exact."""
    if kind == "prod":
        return torch.where(idx % n == r, 2, 1)
    if kind in ("max", "min"):
        return (idx + r) % 5
    return (idx + r) % 3 + 1


def _reduced(kind: str, idx: torch.Tensor, n: int) -> torch.Tensor:
    stack = torch.stack([_values(kind, idx, r, n).double() for r in range(n)])
    if kind == "prod":
        return stack.prod(0)
    if kind == "max":
        return stack.max(0).values
    if kind == "min":
        return stack.min(0).values
    total = stack.sum(0)
    return total / n if kind == "avg" else total


def _mismatch(out: torch.Tensor, expected: torch.Tensor, approximate: bool) -> int:
    got = out.double().reshape(-1)
    if approximate:  # avg: the division rounds differently in NCCL and here
        tolerance = 1e-2 if out.element_size() <= 2 else 1e-6
        return int(((got - expected).abs() > tolerance * expected.abs().clamp(min=1)).sum())
    return int((got != expected).sum())


def build(
    collective: str,
    count: int,
    n: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    op: str,
    root: int,
) -> dict[str, Case]:
    """The out-of-place and in-place cases for one size."""
    if count == 0:  # as NCCL does for an empty buffer: nothing to move, nothing to check
        return {
            "oop": Case(lambda: None, lambda: None, lambda: 0),
            "ip": Case(lambda: None, lambda: None, lambda: 0),
        }
    reduce_op = getattr(dist.ReduceOp, REDUCE_OPS[op])
    total = count * n if collective in PER_RANK else count

    def fill(kind: str, r: int, length: int) -> torch.Tensor:
        idx = torch.arange(length, device=device)
        return _values(kind, idx, r, n).to(dtype)

    if collective in ("all_reduce", "broadcast", "reduce"):
        kind = op if collective != "broadcast" else "sum"
        src = fill(kind, rank, count)
        out = torch.empty_like(src)
        buf = src.clone()
        idx = torch.arange(count, device=device)
        expected = (
            _values(kind, idx, root, n).double()
            if collective == "broadcast"
            else _reduced(kind, idx, n)
        )
        checked_here = collective != "reduce" or rank == root

        def call(t: torch.Tensor) -> None:
            if collective == "all_reduce":
                dist.all_reduce(t, op=reduce_op)
            elif collective == "broadcast":
                dist.broadcast(t, src=root)
            else:
                dist.reduce(t, dst=root, op=reduce_op)

        def oop() -> None:
            out.copy_(src)
            call(out)

        def reset_ip() -> None:
            buf.copy_(src)

        def wrong_of(t: torch.Tensor) -> int:
            return _mismatch(t, expected, op == "avg") if checked_here else 0

        return {
            "oop": Case(oop, lambda: None, lambda: wrong_of(out)),
            "ip": Case(lambda: call(buf), reset_ip, lambda: wrong_of(buf)),
        }

    if collective == "all_gather":
        src = fill("sum", rank, count)
        out = torch.empty(total, dtype=dtype, device=device)
        idx = torch.arange(count, device=device)
        expected = torch.cat([_values("sum", idx, r, n).double() for r in range(n)])
        mine = out[rank * count : (rank + 1) * count]
        return {
            "oop": Case(
                lambda: dist.all_gather_into_tensor(out, src),
                lambda: None,
                lambda: _mismatch(out, expected, False),
            ),
            "ip": Case(
                lambda: dist.all_gather_into_tensor(out, mine),
                lambda: mine.copy_(src),
                lambda: _mismatch(out, expected, False),
            ),
        }

    if collective == "reduce_scatter":
        src = fill(op, rank, total)
        out = torch.empty(count, dtype=dtype, device=device)
        buf = src.clone()
        idx = torch.arange(total, device=device)
        expected = _reduced(op, idx, n)[rank * count : (rank + 1) * count]
        mine = buf[rank * count : (rank + 1) * count]
        return {
            "oop": Case(
                lambda: dist.reduce_scatter_tensor(out, src, op=reduce_op),
                lambda: None,
                lambda: _mismatch(out, expected, op == "avg"),
            ),
            "ip": Case(
                lambda: dist.reduce_scatter_tensor(mine, buf, op=reduce_op),
                lambda: buf.copy_(src),
                lambda: _mismatch(mine, expected, op == "avg"),
            ),
        }

    if collective == "alltoall":
        # chunk j of rank r goes to rank j; its value says where it came from
        chunk = torch.arange(n, device=device).repeat_interleave(count)
        src = (rank * 10 + chunk).to(dtype)
        out = torch.empty_like(src)
        buf = src.clone()
        expected = (chunk * 10 + rank).double()
        return {
            "oop": Case(
                lambda: dist.all_to_all_single(out, src),
                lambda: None,
                lambda: _mismatch(out, expected, False),
            ),
            "ip": Case(
                lambda: dist.all_to_all_single(buf, buf), lambda: buf.copy_(src), lambda: None
            ),
        }

    # sendrecv: a ring, each rank sends to rank+1 and receives from rank-1
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    src = fill("sum", rank, count)
    out = torch.empty_like(src)
    buf = src.clone()
    expected = fill("sum", prv, count).double()

    def ring(send: torch.Tensor, recv: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return run

    return {
        "oop": Case(ring(src, out), lambda: None, lambda: _mismatch(out, expected, False)),
        "ip": Case(ring(buf, buf), lambda: buf.copy_(src), lambda: None),
    }
