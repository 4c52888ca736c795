"""Recording chosen steps of a running rank with torch's profiler, with no change to the script
(`ddpkit profile`, `ddpkit run --profile-steps`).

A plan names the steps, as the step timing numbers them (ddpkit.rank.steps: step 1 is the
first timed step; every rank of the job numbers them alike), so every rank records the same
ones: recording starts at the end of step `first` and stops at the end of step `first +
steps`. Armed by the launcher's environment at start (`--profile-steps`), or on request on a
running job: `ddpkit profile` writes the plan file, then the request; the rank's answering
thread (ddpkit.rank.answering) reads the plan and answers whether it is armed in time (a rank
already past the first step answers so, and the command plans again further on).

Nothing is armed otherwise: the step hook reads one module attribute. Once the last step is
recorded the rank stops the profiler, writes its trace (Chrome/Perfetto JSON, gzipped) and a
summary (its top ops by own time, its communication time, what the recording cost) into the
plan's folder and its state folder, then goes on. A rank that exits during the recording
writes what it recorded.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime

TOP = 12  # ops kept in the summary
# torch's RecordScope of record_function's spans (DDP's forward, the DataLoader's next, gloo's
# collectives): their own time is the Python between the ops inside them, not an op's work, and
# on a loaded machine it came first (rank 1's top op read 'DistributedDataParallel.forward')
USER_SCOPE = 7


@dataclass(frozen=True)
class Plan:
    first: int  # recording starts at the end of this step (0: at the first timed step)
    steps: int  # steps recorded
    folder: str  # where the traces go (the run folder's profile-<first+1>-<last>/)
    shapes: bool = False  # record_shapes
    stack: bool = False  # with_stack
    id: str = ""  # the plan's name: a new plan replaces an armed one

    @property
    def last(self) -> int:
        return self.first + self.steps


@dataclass
class Recording:
    """This rank's recording: a part of its runtime (ddpkit.rank.runtime)."""

    plan: Plan | None = None  # armed; read by the step hook each step
    profiler: Any = None
    began: float = 0.0
    recorded: int = 0


def recording() -> Recording:
    return runtime.current().part(Recording)


def arm_from_environment() -> None:
    """`ddpkit run --profile-steps`: armed from the start."""
    raw = os.environ.get(protocol.PROFILE)
    if raw:
        try:
            _arm(Plan(**json.loads(raw)))
        except (TypeError, ValueError):
            pass


def serve(state_dir: str, rank: str, step_now: Callable[[], int]) -> None:
    """Answer `ddpkit profile`'s requests (the answering thread reads the plan file);
    `step_now`: the number of the step the rank is in, as the step timing numbers them."""
    from ddpkit.rank import answering

    answering.answer(
        state_dir, rank, protocol.PROFILE_REQUEST, protocol.PROFILE_ARMED,
        lambda: _on_request(state_dir, rank, step_now()),
    )  # fmt: skip


def _on_request(state_dir: str, rank: str, now: int) -> bytes:
    try:
        raw = protocol.state_path(state_dir, rank, protocol.PROFILE_PLAN).read_text()
        asked = Plan(**json.loads(raw))
    except (OSError, TypeError, ValueError) as err:
        return json.dumps({"armed": False, "now": now, "why": f"no plan: {err}"}).encode()
    armed = recording().plan
    if armed is not None and armed.id == asked.id:  # the command was stopped: cut the plan
        if recording().profiler is None:  # not begun: nothing is recorded
            _disarm()
            return json.dumps({"armed": False, "now": now, "why": "cancelled"}).encode()
        _arm(asked)  # the hook ends the recording at the end of the new last step, or the next
        return json.dumps({"armed": True, "now": now, "cut": True}).encode()
    if recording().profiler is not None:
        return json.dumps({"armed": False, "now": now, "why": "already recording"}).encode()
    if now >= asked.first:
        return json.dumps({"armed": False, "now": now, "why": "past the first step"}).encode()
    _arm(asked)
    return json.dumps({"armed": True, "now": now}).encode()


def _arm(new: Plan) -> None:
    recording().plan = new


def after_step(number: int, on_gpu: bool) -> None:
    """The step hook, at the end of step `number`, while a plan is armed."""
    rec = recording()
    armed = rec.plan
    if armed is None:
        return
    if rec.profiler is None:
        if number == armed.first:
            _start(armed, on_gpu)
        elif number > armed.first:  # started after the first step (a new attempt): missed
            _write_summary(armed, {"missed": True, "now": number})
            _disarm()
        return
    rec.recorded = number - armed.first
    if number >= armed.last:
        _finish(armed, ended_early=False)


def _start(armed: Plan, on_gpu: bool) -> None:
    import torch.profiler

    rec = recording()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rec.profiler = torch.profiler.profile(
        activities=activities, record_shapes=armed.shapes, with_stack=armed.stack
    )
    rec.profiler.start()
    rec.began, rec.recorded = time.perf_counter(), 0
    _mark(True)
    atexit.register(_at_exit)


def _at_exit() -> None:
    rec = recording()
    if rec.profiler is not None and rec.plan is not None:
        _finish(rec.plan, ended_early=True)


def _finish(armed: Plan, ended_early: bool) -> None:
    """Stop, write the trace and the summary; the plan is done."""
    rec = recording()
    profiler, rec.profiler = rec.profiler, None
    _disarm()
    seconds = time.perf_counter() - rec.began
    profiler.stop()
    rank = runtime.current().rank_name
    folder = Path(armed.folder)
    trace = folder / f"rank{rank}.trace.json.gz"
    began = time.perf_counter()
    facts: dict[str, Any] = {
        "seconds": seconds, "recorded": rec.recorded, "ended_early": ended_early
    }  # fmt: skip
    try:
        folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
        facts["trace"] = str(trace)
    except Exception as err:  # a full disk: the summary still says what happened
        facts["trace_error"] = f"{type(err).__name__}: {err}"
    facts.update(summarise(profiler))
    facts["export_s"] = time.perf_counter() - began
    _write_summary(armed, facts)
    _mark(False)  # after the export too: it holds more memory still


def _mark(recording: bool) -> None:
    """The launcher's memory watch reads this: the profiler's events are no leak."""
    here = runtime.current()
    if not here.state_dir:
        return
    path = here.path(protocol.PROFILING)
    try:
        if recording:
            path.touch()
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _disarm() -> None:
    recording().plan = None


def summarise(profiler: Any) -> dict[str, Any]:
    """The top ops by own time (on the GPU when it ran there; spans named with record_function
    left out), and the communication time."""
    averages = profiler.key_averages()
    on_gpu = any(_device_time(e) > 0 for e in averages)
    rows = []
    comm = 0.0
    for e in averages:
        own = _device_time(e) if on_gpu else float(e.self_cpu_time_total)
        name = str(e.key)
        if on_gpu and name.lower().startswith("nccl"):  # NCCL's kernels
            comm += _device_time(e) / 1e6
        elif not on_gpu and name.startswith("gloo:"):  # gloo's threads' spans
            comm += float(e.cpu_time_total) / 1e6
        if own > 0 and getattr(e, "scope", None) != USER_SCOPE:
            rows.append((name, own / 1e6, int(e.count)))
    rows.sort(key=lambda r: -r[1])
    every = sum(seconds for _, seconds, _ in rows)  # every op's own time: what the top ones are of
    return {"device": "gpu" if on_gpu else "cpu", "top": rows[:TOP], "comm_s": comm,
            "ops_s": every, "ops": len(rows)}  # fmt: skip


def _device_time(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def _write_summary(armed: Plan, facts: dict[str, Any]) -> None:
    here = runtime.current()
    rank = here.rank_name
    text = json.dumps({"rank": int(rank), "plan": asdict(armed), **facts})
    places = [Path(armed.folder) / f"rank{rank}.summary.json"]
    if here.state_dir:
        places.append(here.path(protocol.PROFILE_DONE))
    for path in places:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        except OSError:
            pass
