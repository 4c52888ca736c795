"""The ddpkit command's surface: fast help, version, errors without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpkit import __version__
from ddpkit.cli import COMMANDS, build_parser, main


def ddpkit(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, timeout=60, **kw
    )


def test_help_lists_every_command():
    out = ddpkit("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_version_answers():
    out = ddpkit("--version")
    assert out.stdout.strip() == f"ddpkit {__version__}"


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)],
)
def test_help_and_version_never_import_torch(args):
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpkit", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported
    assert out.returncode == 0


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error():
    out = ddpkit("frobnicate")
    assert out.returncode == 2
    assert "error:" in out.stderr
    assert "fix:" in out.stderr


def _torchrun_only(action) -> bool:
    from ddpkit.launch.base import torchrun_flags

    names = {*torchrun_flags.UNSUPPORTED, "use-env", "use-local-rank-arg", "redirects", "tee"}
    names |= {"rdzv-backend", "standalone", "monitor-interval", "start-method", "role"}
    names |= {"run-path", "local-ranks-filter", "signals-to-handle"}
    return action.dest.replace("_", "-") in names


def test_every_run_flag_has_an_environment_variable():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    for action in run._actions:
        if action.dest in ("help", "module", "no_python") or _torchrun_only(action):
            continue
        assert f"$DDPKIT_{action.dest.upper()}" in action.help


def test_run_flags_are_pinned():
    """Flags are an interface: adding one is a decision, so this list changes with it."""
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    flags = sorted(s for a in run._actions for s in a.option_strings if s.startswith("--"))
    assert flags == sorted(
        [
            "--help",
            "--nproc-per-node",
            "--nproc_per_node",
            "--nnodes",
            "--node-rank",
            "--node_rank",
            "--rdzv",
            "--master-addr",
            "--master_addr",
            "--master-port",
            "--master_port",
            "--max-restarts",
            "--max_restarts",
            "--no-spares",
            "--grace",
            "--init-timeout",
            "--init_timeout",
            "--log-dir",
            "--log_dir",
            "--log-level",
            "--log_level",
            "--profile-steps",
            "--profile_steps",
            "--ranks",
            "--run-id",
            "--run_id",
            "--module",
            "--no-python",
            "--hang-timeout",
            "--hang-min",
            "--hang_timeout",
            "--hang_min",
            "--straggler-threshold",
            "--straggler_threshold",
            "--straggler-window",
            "--straggler_window",
            "--check-collectives",
            "--memory-snapshot",
            "--node-timeout",
            "--node_timeout",
            "--local-addr",
            "--local_addr",
            "--rdzv-conf",
            "--rdzv_conf",
            "--stdin",
            "--no_python",
            # torchrun's (torch 2.11 `torchrun --help`), accepted or refused with a fix
            *("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id"),
            *("--shutdown-timeout", "--shutdown_timeout", "--rdzv-backend", "--rdzv_backend"),
            *("--standalone", "--monitor-interval", "--monitor_interval", "--start-method"),
            *("--start_method", "--role", "--run-path", "--run_path", "--redirects", "--tee"),
            *("--local-ranks-filter", "--local_ranks_filter", "--signals-to-handle"),
            *("--signals_to_handle", "--event-log-handler", "--event_log_handler"),
            *("--logs-specs", "--logs_specs", "--numa-binding", "--numa_binding"),
            *("--virtual-local-rank", "--virtual_local_rank", "--duplicate-stdout-filters"),
            *("--duplicate_stdout_filters", "--duplicate-stderr-filters"),
            *("--duplicate_stderr_filters", "--use-local-rank-arg", "--use_local_rank_arg"),
            *("--use-env", "--use_env"),
        ]
    )


def test_debug_flag_shows_the_traceback(tmp_path):
    out = ddpkit("--debug", "run", "-n", "0", "x.py", cwd=tmp_path)
    assert "Traceback" in out.stderr


def test_user_errors_have_no_traceback(tmp_path):
    out = ddpkit("run", "-n", "0", "x.py", cwd=tmp_path, env={**os.environ})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
