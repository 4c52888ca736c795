"""`ddpkit.spawn(fn, args, nprocs)`: mp.spawn's call, with `ddpkit run` underneath.

    import ddpkit

    def main(rank, world_size, epochs):
        ...

    if __name__ == "__main__":
        ddpkit.spawn(main, args=(world_size, epochs), nprocs=world_size)

The launcher runs in the calling process, as under `ddpkit run`: the same `[rank N]` output,
verdicts, hang watch, stop signals and restarts, and `ddpkit ps/top/stacks/kill/profile` see
the job. Each rank runs `fn(local_rank, *args)` (mp.spawn's first argument: the process index,
the rank on one node) in a fresh process that re-imports the script as `__mp_main__`, as
mp.spawn's default start method does: what is under `if __name__ == "__main__":` does not run
again there. `args` travel pickled.

Options are `ddpkit run`'s, as keyword arguments by their flag's name (`hang_timeout=60`,
`max_restarts=2`, `log_dir="runs"`), else from DDPKIT_<OPTION>, else the defaults.

A job that does not end well raises `JobFailedError` (its exit code, the root cause and its fix, the
run folder); Ctrl+C ends every rank within the grace, then raises KeyboardInterrupt.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.errors import ConfigError, DdpkitError

ARGS_FILE = "spawn-args.pickle"


class JobFailedError(DdpkitError):
    """The spawned job failed, hung or was stopped: `exit_code` (as `ddpkit run` would exit),
    `root_cause`, `fix` and `run_dir` (its logs and report.txt)."""

    def __init__(self, exit_code: int, root_cause: str, fix: str, run_dir: Path | None) -> None:
        where = f"; its report: {run_dir / 'report.txt'}" if run_dir is not None else ""
        super().__init__(f"the job ended with exit code {exit_code}: {root_cause}{where}", fix)
        self.exit_code = exit_code
        self.root_cause = root_cause
        self.run_dir = run_dir


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int | str | None = None,
    **options: Any,
) -> None:
    """Run `fn(local_rank, *args)` on `nprocs` ranks (default: one per GPU, else 2 on the CPU)
    under ddpkit's launcher; return once every rank ended well."""
    from ddpkit.errors import install_excepthook

    install_excepthook()  # uncaught, a ddpkit error is said in a line and its fix, no traceback
    if os.environ.get(protocol.STATE_DIR):
        raise ConfigError(
            "ddpkit.spawn was called inside a rank of a job: each rank would start ranks of "
            "its own",
            "start the script with `python script.py` (ddpkit.spawn starts the ranks), or call "
            "fn directly when `ddpkit run` starts them",
        )
    target, qualname = where_to_find(fn)
    from ddpkit.launch.base import config

    if "nproc_per_node" in options and nprocs is not None:
        raise ConfigError("ddpkit.spawn was given both nprocs and nproc_per_node", "give nprocs")
    nprocs = options.pop("nproc_per_node", nprocs)
    with tempfile.TemporaryDirectory(prefix="ddpkit-spawn-") as folder:
        pickled = Path(folder) / ARGS_FILE
        try:
            # the caller's argv, readable before the script is imported again; then its args
            pickled.write_bytes(pickle.dumps((list(sys.argv), pickle.dumps(tuple(args)))))
        except Exception as err:
            raise ConfigError(
                f"ddpkit.spawn could not pickle args: {type(err).__name__}: {err}",
                "pass what pickle can carry to another process (numbers, strings, tensors, "
                "objects of importable classes); open files, locks and lambdas cannot go",
            ) from None
        values: dict[str, object] = {
            k: v if isinstance(v, bool) else str(v) for k, v in options.items()
        }
        try:
            script = config.build(
                "script" if target.endswith(".py") else "module",
                target or "ddpkit",  # a notebook's function: no script, any module will do
                (),
                None,
                nproc_per_node=None if nprocs is None else str(nprocs),
                **values,
            )
        except TypeError as err:  # an option ddpkit run does not have
            raise ConfigError(
                f"ddpkit.spawn: {err}",
                "give ddpkit run's options by their flag's name, dashes as underscores "
                "(hang_timeout=60, max_restarts=2, log_dir='runs'): `ddpkit run --help` "
                "lists them",
            ) from None
        if target:
            cfg = config.replace(script, kind="function", args=(qualname, str(pickled)))
        else:  # each rank a fork of this process, which alone holds fn; no warm spares then
            from ddpkit.rank.bootstrap import run_forked

            call = (run_forked, (fn, tuple(args)))
            cfg = config.replace(
                script, kind="function", target="<notebook>", args=(), forked=call, spares=False
            )
        from ddpkit.cli.run import start_job

        ended = start_job(cfg)
    if ended.exit_code == 0:
        return
    outcome = ended.outcome
    summary = outcome.summary if outcome is not None else "the job did not start"
    if outcome is not None and outcome.interrupted and ended.exit_code == 130:
        raise KeyboardInterrupt(summary)
    fix = outcome.fix if outcome is not None else ""
    raise JobFailedError(ended.exit_code, summary, fix, ended.run_dir)


def where_to_find(fn: Callable[..., Any]) -> tuple[str, str]:
    """(the script's path or the module's name, fn's qualified name): where a rank finds fn."""
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not qualname or "<" in qualname or module is None:
        raise ConfigError(
            f"ddpkit.spawn needs a function defined at the top of a script or module; got {fn!r}",
            "define fn with `def` at the top level of the script (not a lambda, not inside "
            "another function), as mp.spawn needs",
        )
    if module != "__main__":
        return module, qualname
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if path and os.path.exists(path):
        return os.path.abspath(path), qualname
    # defined in a notebook or at the Python prompt: no file to import it from, so each rank
    # is a fork of this process (as notebook_launcher does), which CUDA must not be used in yet
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise ConfigError(
            "ddpkit.spawn forks the ranks from this kernel (its function was defined here), and "
            "CUDA is already initialised in it: a forked process cannot use CUDA",
            "restart the kernel and call ddpkit.spawn before anything touches the GPU in it "
            "(torch.cuda calls, .cuda(), .to('cuda')): put that work inside the function; or "
            "move the function to a .py file next to the notebook and import it (the ranks then "
            "start fresh)",
        )
    return "", qualname
