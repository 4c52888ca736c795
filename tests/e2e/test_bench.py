"""ddpkit bench on CPU with gloo (2-3 ranks): the table reads like nccl-tests', the formulas
hold row by row, results are checked, files are written, and bad flags are refused."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.bench.collectives import bus_factor
from ddpkit.bench.options import COLLECTIVES, DTYPES, OPS

pytestmark = pytest.mark.timeout(180)
ANCHOR = Path(__file__).parents[2] / "benchmarks" / "anchors" / "h200x2" / "nt_all_reduce.txt"
BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def bench(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "bench", *args],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=cwd,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
    )


def rows(stdout: str) -> list[list[str]]:
    return [
        line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")
    ]


def test_every_collective_runs_in_one_job_checks_and_obeys_the_formulas(tmp_path):
    # `ddpkit bench all`: each collective's table in turn, as each nccl-tests binary prints
    # it, with the root, aggregation, blocking and warm-up flags used, and its own files
    n = 3
    flags = ["-b", "64", "-e", "4K", "-f", "4", "-n", "3", "-w", "2", "-r", "1", "-a", "3"]
    files = ["--json", "r.json", "--csv", "r.csv", "--plot", "r.png", "--peak", "10"]
    out = bench("all", *flags, "-z", "1", "-g", str(n), *files, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    starts = "# Collective test starting: "
    sections = [starts + x for x in out.stdout.split(starts)[1:]]
    assert [x[len(starts) :].split("_perf", 1)[0] for x in sections] == list(COLLECTIVES)
    for collective, section in zip(COLLECTIVES, sections, strict=True):
        lines = section.splitlines()
        assert lines[1].startswith(
            f"# nThread 1 nGpus {n} minBytes 64 maxBytes 4096 step: 4(factor) "
            "warmup iters: 2 iters: 3 agg iters: 1 validation: 1 graph: 0"
        )
        assert sum(line.startswith("#  Rank ") for line in lines) == n
        # the three column-header rows, byte for byte as nccl-tests prints them
        anchor = ANCHOR.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if "out-of-place" in line)
        assert lines[start : start + 3] == anchor[8:11]
        table = rows(section)
        assert len(table) == 4  # 64, 256, 1K, 4K
        for r in table:
            size, count = int(r[0]), int(r[1])
            spread = collective in ("all_gather", "reduce_scatter", "alltoall")
            assert size == (count * n * 4 if spread else count * 4)
            assert r[2:4] == ["float", "sum" if collective in ("all_reduce", "reduce_scatter",
                                                              "reduce") else "none"]  # fmt: skip
            assert r[4] == ("1" if collective in ("broadcast", "reduce") else "-1")
            for time, algbw, busbw in ((r[5], r[6], r[7]), (r[9], r[10], r[11])):
                assert float(algbw) == pytest.approx(size / float(time) / 1e3, abs=0.006)
                assert float(busbw) == pytest.approx(
                    float(algbw) * BUS[collective](n), abs=0.005 * (1 + BUS[collective](n)) + 1e-9
                )
            assert r[8] == "0"
            assert r[12] in ("0", "N/A")
        assert f"# Collective test concluded: {collective}_perf" in section
        assert "# Avg bus bandwidth    : " in section
        assert "of the 10 GB/s one-way peak" in section
        data = json.loads((tmp_path / f"r.{collective}.json").read_text())
        assert data["schema"] == "ddpkit.bench/1"
        assert len(data["rows"]) == 4
        assert data["rows"][0]["oop"]["peak_fraction"] == pytest.approx(
            data["rows"][0]["oop"]["busbw"] / 10
        )
        assert data["avg_busbw"] >= 0
        csv_rows = list(csv.DictReader((tmp_path / f"r.{collective}.csv").open()))
        assert [int(r["size"]) for r in csv_rows] == [r["size"] for r in data["rows"]]
        assert (tmp_path / f"r.{collective}.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "r.json").exists()


def test_one_collectives_files_keep_the_names_given():
    from ddpkit.bench.worker import _named

    assert _named("out/r.json", "all_gather", every=False) == "out/r.json"
    assert _named("out/r.json", "all_gather", every=True) == "out/r.all_gather.json"
    assert _named("out.d/r", "reduce", every=True) == "out.d/r.reduce"


def test_bus_factors_are_nccl_tests_definitions():
    for name, factor in BUS.items():
        assert bus_factor(name, 8) == pytest.approx(factor(8))


def test_a_planted_wrong_result_is_counted_and_exits_7():
    out = bench(
        "all_reduce", "-b", "1K", "-e", "1K", "-g", "2", env={"DDPKIT_BENCH_PLANT_WRONG": "1"}
    )
    assert out.returncode == 7
    assert rows(out.stdout)[0][8] == "1"
    assert "differ from the exact result" in out.stderr


def test_every_reduction_and_type_is_exact_in_nccl_tests_order():
    # `-o all -d all` as in nccl-tests: every type, within it every reduction gloo has
    out = bench("all_reduce", "-b", "256", "-e", "256", "-o", "all", "-d", "all", "-g", "3")
    assert out.returncode == 0, out.stderr
    got = [(r[2], r[3], r[8], r[12]) for r in rows(out.stdout)]
    ops = [op for op in OPS if op != "avg"]  # gloo has no average (refused: bad flags below)
    assert got == [(dtype, op, "0", "0") for dtype in DTYPES for op in ops]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["all_reduce", "-b", "1X"], "-b '1X' is not a size"),
        (["all_reduce", "-b", "2M", "-e", "1M"], "is larger than -e"),
        (["all_reduce", "-n", "0"], "-n '0' must be at least 1"),
        (["all_reduce", "-o", "xor"], "-o 'xor' is not one of"),
        (["all_reduce", "-d", "float8"], "-d 'float8' is not one of"),
        (["all_reduce", "-c", "2"], "-c '2' is not one of"),
        (["all_reduce", "-a", "7"], "-a '7' is not one of"),
        (["broadcast", "-r", "5", "-g", "2"], "-r 5 but only 2 rank(s)"),
        (["all_reduce", "-G", "10"], "needs GPUs"),
        (["all_reduce", "-o", "avg"], "gloo has no average"),
        (["all_reduce", "--peak", "fast"], "is not a bandwidth"),
        (["all_reduce", "-g", "0"], "must be at least 1"),
        (["all_reduce", "-f", "x"], "-f 'x' is not an integer"),
        (["all_reduce", "-i", "0"], "never reaches -e"),
        (["all_reduce", "-z", "3"], "-z '3' is not one of"),
        (["all_reduce", "-w", "-1"], "-w '-1' must be at least 0"),
    ],
)
def test_bad_flags_are_refused_with_exit_2(args, says):
    if args[-1] == "0" and args[-2] == "-i":
        args = [*args, "-b", "1K", "-e", "2K"]
    out = bench(*args)
    assert out.returncode == 2
    assert says in out.stderr
    assert "fix:" in out.stderr


def test_plot_without_matplotlib_is_a_clear_error_before_anything_starts(tmp_path):
    blocked = tmp_path / "no_matplotlib"  # a machine where matplotlib is not installed
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    path = os.pathsep.join(p for p in (str(blocked), os.environ.get("PYTHONPATH")) if p)
    out = bench("all_reduce", "-b", "8", "-e", "8", "--plot", "r.png", env={"PYTHONPATH": path})
    assert out.returncode == 2, out.stderr
    assert "--plot needs matplotlib" in out.stderr
    assert "pip install 'ddpkit[plot]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "foreign"),
    [(["ddp", "-g", "2"], "-g"), (["all_reduce", "--gpus", "2"], "--gpus")],
)
def test_a_flag_of_the_other_bench_is_refused(args, foreign):
    out = bench(*args)
    assert out.returncode == 2
    assert f"does not know {foreign}" in out.stderr
