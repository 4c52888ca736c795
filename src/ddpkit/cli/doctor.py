"""`ddpkit doctor [script.py]`: report the machine, check what breaks multi-GPU jobs (each
finding with a fix), scan a script for the classic mistakes, and run a real collective."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

SMOKE_BOUND = 180  # seconds: the smoke test never takes longer, hung or not


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="check this machine for multi-GPU problems, with fixes", description=__doc__
    )
    p.add_argument("script", nargs="?", help="also scan this training script")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-smoke", action="store_true", help="skip the collective smoke test")
    p.add_argument("--strict", action="store_true", help="treat warnings as errors")
    nodes = p.add_argument_group(
        "several nodes", "run the same command on every node: the smoke test spans them all"
    )
    nodes.add_argument("--nnodes", default="1", help="number of nodes (default 1)")
    nodes.add_argument("--rdzv", metavar="HOST:PORT", help="where the nodes meet")
    nodes.add_argument("--node-rank", help="this node's rank, for static nodes")
    nodes.add_argument("--master-addr", help="node 0's address, for static nodes")
    nodes.add_argument("--master-port", help="the job's store port, for static nodes")
    p.set_defaults(handler=run)


NODE_FLAGS = ("nnodes", "rdzv", "node_rank", "master_addr", "master_port")


def run(args: argparse.Namespace) -> int:
    from ddpkit.doctor import checks, facts, script

    # a script that cannot be read is said at once, before the facts import torch
    parsed = script.parse(args.script) if args.script else None
    environ = dict(os.environ)
    found = facts.gather(environ)
    findings = checks.run_all(found, environ)
    scanned = None
    if args.script:
        in_script = script.scan(args.script, gpus=len(found.gpus), parsed=parsed)
        scanned = {"path": args.script, "findings": len(in_script)}
        findings += in_script
        findings.sort(key=lambda f: checks.LEVELS.index(f.level))  # problems first
    spread = [
        f"--{flag.replace('_', '-')}={value}"
        for flag in NODE_FLAGS
        if (value := getattr(args, flag)) is not None and (flag, value) != ("nnodes", "1")
    ]
    smoke = None if args.no_smoke else smoke_test(len(found.gpus), spread)
    if smoke is not None and smoke.get("ok"):
        findings[:0] = checks.across_nodes(smoke.get("nodes", []))
        for slow in smoke.get("transport", {}).get("slow", []):  # a slower NCCL path taken
            findings.insert(
                0,
                checks.Finding(
                    "warning",
                    "nccl-transport",
                    slow["what"],
                    "NCCL's own log of the smoke test: a faster path exists",
                    slow["fix"] or "see docs/why-slow.md",
                ),
            )
    if smoke is not None and not smoke.get("ok"):
        findings.insert(
            0,
            checks.Finding(
                "error",
                "smoke",
                smoke["what"],
                "a real collective across the local ranks failed",
                "read the output below; fix the errors above first, then rerun `ddpkit doctor`",
            ),
        )
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    if args.json:
        print(
            json.dumps(
                {
                    "schema": "ddpkit.doctor/1",
                    "facts": found.to_dict(),
                    "findings": [f.to_dict() for f in findings],
                    "smoke": smoke,
                    "script": scanned,
                    "summary": {"errors": errors, "warnings": warnings},
                },
                indent=2,
            )
        )
    else:
        print(render(found, findings, smoke, errors, warnings, scanned))
    return 1 if errors or (args.strict and warnings) else 0


def smoke_test(gpus: int, spread: list[str] | None = None) -> dict[str, Any]:
    """All-reduce across every local GPU (or 2 CPU ranks) through ddpkit run, bounded; with
    `spread` (--nnodes/--rdzv/...) across every node's."""
    from ddpkit.launch.subjob import run_job

    job = run_job(
        [
            *(spread or []),
            "-n",
            "gpu" if gpus else "cpu",
            "--init-timeout",
            "60",
            "--hang-timeout",
            "30",
            "--grace",
            "2",
            *([] if spread else ["--ranks", "0"]),
            "-m",
            "ddpkit.doctor.smoke",
        ],
        "DDPKIT_SMOKE",
        SMOKE_BOUND,
    )
    if job.exit_code is None:
        return {
            "ok": False,
            "what": f"the smoke test did not finish in {SMOKE_BOUND} s",
            "output": job.output,
        }
    if not job.ok or job.result is None:
        return {
            "ok": False,
            "what": f"the smoke test failed (exit {job.exit_code})",
            "output": job.output,
        }
    if job.result["wrong"]:
        return {
            "ok": False,
            "what": f"all_reduce gave {job.result['wrong']} wrong element(s)",
            **job.result,
        }
    return {"ok": True, **job.result, "transport": job.transport}


def render(
    found: Any,
    findings: list[Any],
    smoke: dict[str, Any] | None,
    errors: int,
    warnings: int,
    scanned: dict[str, Any] | None = None,
) -> str:
    lines = [f"ddpkit doctor: {errors} error(s), {warnings} warning(s)"]
    if scanned is not None:
        n = scanned["findings"]
        lines.append(
            f"scanned {scanned['path']} (read, not run): "
            + (f"{n} finding(s) below, marked with its lines" if n else "nothing found")
        )
    lines.append("")
    for f in findings:
        where = f" [{f.where}]" if f.where else ""
        lines.append(f"{f.level.upper():<8}{f.what}{where}")
        lines.append(f"        why: {f.why}")
        lines.append(f"        fix: {f.fix}")
    if findings:
        lines.append("")
    gpus = (
        "; ".join(
            f"{g.index}: {g.name}, {g.memory_mib} MiB, {g.bus_id or '?'}"
            + (f", NVLink{g.nvlink_version} x{g.nvlinks_active}" if g.nvlinks_active else "")
            + (f", used by {g.processes}" if g.processes else "")
            for g in found.gpus
        )
        or "none"
    )
    shm = f"{found.shm_bytes / 2**30:.1f} GiB" if found.shm_bytes else "?"
    memlock = "unlimited" if found.memlock_bytes is None else f"{found.memlock_bytes // 1024} KiB"
    rows = [
        ("system", f"{found.os}, kernel {found.kernel}, {found.cpu_cores} cores"),
        ("python", found.python),
        (
            "torch",
            f"{found.torch or 'not installed'} (CUDA {found.torch_cuda or '-'}, NCCL "
            f"{found.nccl or ('built in' if found.nccl_built else 'not built')})",
        ),
        ("driver", f"{found.driver or '-'} (CUDA up to {found.driver_cuda or '-'})"),
        ("gpus", gpus),
        (
            "peer access",
            ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in found.peer_access.items()) or "-",
        ),
        ("/dev/shm", shm),
        ("memlock", memlock),
        ("infiniband", ", ".join(found.infiniband) or "none"),
        (
            "interfaces",
            ", ".join(f"{k} {' '.join(v)}".strip() for k, v in sorted(found.interfaces.items())),
        ),
    ]
    lines += [f"{k:<12} {v}" for k, v in rows]
    if found.variables:
        lines.append("variables    " + " ".join(f"{k}={v}" for k, v in found.variables.items()))
    if found.topology:
        lines += ["", found.topology]
    if smoke is not None:
        lines.append("")
        if smoke.get("ok") and smoke.get("busbw_gbps") is None:
            lines.append(
                f"smoke test   all_reduce on {smoke['ranks']} rank ({smoke['backend']}): "
                "correct; one rank moves no data, so no bandwidth is measured (with 2 or "
                "more GPUs the doctor times the link)"
            )
        elif smoke.get("ok"):
            lines.append(
                f"smoke test   all_reduce on {smoke['ranks']} rank(s) "
                f"({smoke['backend']}): correct; {smoke['bytes'] // 2**20} MiB in "
                f"{smoke['time_us']:.0f} us, busbw {smoke['busbw_gbps']} GB/s"
            )
            transport = smoke.get("transport", {})
            if transport.get("line"):
                lines.append(f"  NCCL transport: {transport['line']}")
            for slow in transport.get("slow", []):
                lines.append(f"  warning: {slow['what']}; fix: {slow['fix']}")
            if len(smoke.get("nodes", [])) > 1:
                lines += [
                    f"  node {n['host']}: torch {n['torch']}, NCCL {n['nccl'] or '-'}, driver "
                    f"{n['driver'] or '-'}, reaches node 0 from {n['address']} ({n['interface']})"
                    for n in smoke["nodes"]
                ]
        else:
            lines.append(f"smoke test   FAILED: {smoke['what']}")
            lines += ["  | " + x for x in str(smoke.get("output", "")).splitlines()[-15:]]
    return "\n".join(lines)
