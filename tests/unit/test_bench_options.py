"""`-o all` and `-d all` as nccl-tests reads them: every reduction the backend has, and every
type. (The run itself, nested as nccl-tests nests it, is in tests/e2e/test_bench.py.)"""

from __future__ import annotations

from ddpkit.bench.options import DTYPES, OPS, BenchConfig


def test_all_reductions_on_nccl_include_the_average_and_on_gloo_leave_it_out():
    cfg = BenchConfig("all_reduce", op="all")
    assert cfg.ops(gpu=True) == OPS
    assert cfg.ops(gpu=False) == ("sum", "prod", "max", "min")


def test_all_types_are_every_type():
    assert BenchConfig("all_reduce", dtype="all").dtypes() == DTYPES


def test_one_named_reduction_and_type_are_just_that():
    cfg = BenchConfig("all_reduce", op="max", dtype="int8")
    assert (cfg.ops(gpu=False), cfg.dtypes()) == (("max",), ("int8",))
