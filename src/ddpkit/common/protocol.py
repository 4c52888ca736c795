"""What passes between the launcher (`ddpkit.launch`) and each rank (`ddpkit.rank`), in one place.

Two programs meet here and nowhere else: the launcher starts every worker with the variables
below and reads the files each rank writes into the run's state folder; the rank side (the
bootstrap, the progress record, the flight-recorder server) writes them. Neither side imports
the other. Nothing here imports torch.

The worker contract's variables start with `_DDPKIT_`, so they can never be mistaken for the
options' variables (`DDPKIT_<OPTION>`, read by `ddpkit run`): `DDPKIT_RUN_ID=x sleep 40` is
not a process of job x.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

# -- variables the launcher gives every worker (besides torchrun's) -------------------------

JOB = "_DDPKIT_JOB"  # the job's run id: marks every process of the job, children included
LAUNCHER_PID = "_DDPKIT_LAUNCHER_PID"  # the launcher that started this worker
STATE_DIR = "_DDPKIT_STATE_DIR"  # where this rank writes its state files
INIT_TIMEOUT = "_DDPKIT_INIT_TIMEOUT"  # setup()'s bound at init, looser than the launcher's
BACKEND = "_DDPKIT_BACKEND"  # "gloo" when the launcher started CPU processes
TRACK = "_DDPKIT_TRACK"  # "0": no per-collective records (benchmarks)
# for a program that runs `ddpkit run` (the doctor's smoke test): where the launcher also
# writes NCCL's transport as it found it (JSON: {"line": ..., "slow": [{"what", "fix"}]})
TRANSPORT_TO = "_DDPKIT_TRANSPORT_TO"
RANK_PID = "_DDPKIT_RANK_PID"  # set by the bootstrap: its children are not the rank
FRAMED = "_DDPKIT_FRAMED"  # "1": stdout and stderr share one pipe; frame sys.stderr's writes
# rank 0 of a one-node job: the launcher's listening socket (this fd number), on which rank 0
# serves the job's TCPStore once torch.distributed is imported (ddpkit.common.store_server)
STORE_FD = "_DDPKIT_STORE_FD"
# --memory-snapshot: how many allocator events each GPU rank records (torch's memory history)
MEMORY_HISTORY = "_DDPKIT_MEMORY_HISTORY"
PROFILE = "_DDPKIT_PROFILE"  # --profile-steps: the plan (JSON, ddpkit.rank.profiling.Plan)
WORKER_VARIABLES = (
    JOB, LAUNCHER_PID, STATE_DIR, INIT_TIMEOUT, BACKEND, TRACK, RANK_PID, FRAMED, STORE_FD,
    MEMORY_HISTORY, PROFILE,
)  # fmt: skip


def job_of(environ: Mapping[str, str]) -> str | None:
    """The run id of the ddpkit job a process with this environment belongs to."""
    return environ.get(JOB) or None


# -- the rank's state files ------------------------------------------------------------------

PHASE = "phase"  # "started|init|ready TIME": where the rank is in start-up
ERROR = "error"  # the rank's uncaught error (ErrorRecord as JSON)
STACKS = "stacks"  # faulthandler's dumps, appended on request
PROGRESS = "progress"  # the memory-mapped progress record (Record)
FLIGHT_REQUEST = "fr-request"  # the launcher asks for a full flight-recorder dump
FLIGHT_DUMP = "fr"  # the rank's answer (pickled dump)
# the hang watch's polls ask for the process groups' status only, in files of their own: a poll
# still unanswered when a report asks for the full dump must not be answered in its place
FLIGHT_STATUS_REQUEST = "fr-status-request"
FLIGHT_STATUS_DUMP = "fr-status"
FLIGHT_READY = "fr-ready"  # exists once the rank answers dump requests
# a peer failed while this rank may be blocked on it (NCCL, a peer's connections held open):
# the rank writes the last completed step's state from a thread of its own (ddpkit.train.rescue)
RESCUE_REQUEST = "rescue-request"
RESCUE_DONE = "rescue-done"  # its answer: what it did, in words
RESCUE_READY = "rescue-ready"  # exists once the rank keeps a step it could write
# `ddpkit profile`: the plan (JSON, ddpkit.rank.profiling.Plan), then the request; the rank
# answers whether it armed, and writes what it recorded once done (JSON)
PROFILE_PLAN = "profile-plan"
PROFILE_REQUEST = "profile-request"
PROFILE_ARMED = "profile-armed"
PROFILE_DONE = "profile-done"
PROFILING = "profiling"  # exists while the rank's profiler records (its memory grows then)
# the most steps one recording holds: every op's events stay in the rank's memory until the
# last step (512 steps of a small MLP on 2 CPU ranks: 2.8 GB resident, 28 s to write, measured)
MOST_PROFILE_STEPS = 100
TORCH_ERROR = "torch-error.json"  # TORCHELASTIC_ERROR_FILE: what torch's @record writes
GRACEFUL = "graceful"  # exists once the rank reads s.stop_requested: it saves before it stops
GROUP = "group"  # the default process group's backend and collective timeout (JSON)
FAULT = "fault"  # faulthandler's dump when the rank dies of SIGSEGV, SIGABRT, SIGBUS, ...
MEMORY = "memory"  # what the rank's memory held when it ran out (JSON: ddpkit.rank.oom_facts)
MEMORY_SNAPSHOT = "memory-snapshot.pickle"  # --memory-snapshot: torch's allocator history
MEMORY_PLOT = "memory.png"  # --memory-snapshot: the rank's allocated memory over its last events
RNG = "rng"  # the random streams at the last step's boundary (ddpkit.train.rng_file)
MODULES = "modules"  # the modules the rank imported from installed packages, at its first step
COUNT = "count"  # the job's optimizer steps as this rank counts them (StepCount, mapped)
ENDED = "ended"  # "CODE TIME": the rank ended by itself, with this code, at this wall time

# The launcher asks a rank for its stacks with this signal (faulthandler answers it even while
# the rank is blocked in C code). A real-time signal: SIGUSR1/SIGUSR2 belong to the user's
# script (SLURM pre-emption, its own handlers), and no library here uses SIGRTMIN+5.
STACKS_SIGNAL = signal.SIGRTMIN + 5
# A warm spare's process name while it waits to take a rank's place (ddpkit.launch.spares)
SPARE_NAME = b"ddpkit-spare"
PHASES = ("started", "init", "ready")

# A worker's stdout and stderr share one pipe (one ordered stream); the bootstrap frames what
# Python writes to sys.stderr between these, so the launcher can send it to its own stderr.
ERR_START = b"\x1e\x02"
ERR_END = b"\x1e\x03"
# what goes to the rank's log but not the console: a peer's failure's whole traceback (the
# report names the root cause), ddpkit's own error (the report prints it once for the job)
LOG_START = b"\x1e\x04"
LOG_END = b"\x1e\x05"
LOG_ONLY = 3  # the stream number of what is between LOG_START and LOG_END

# Words by which a rank's error says it failed because of a peer (the peer closed its
# connections, died, or a timeout ran out while it waited for one): never the root cause while
# another rank failed for itself.
VICTIM_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker",
    "Broken pipe",
    "NCCL communicator was aborted",
)
WAITING_WORDS = VICTIM_WORDS + (
    "Timed out waiting",
    "timed out",
    "Timed out",
    "Watchdog caught collective operation timeout",
)


def state_path(state_dir: str | Path, rank: int | str, name: str) -> Path:
    """The file `name` (one of the names above) of `rank` in a state folder."""
    return Path(state_dir) / f"rank{rank}.{name}"


def write_phase(state_dir: str | Path, rank: int | str, phase: str) -> None:
    state_path(state_dir, rank, PHASE).write_text(f"{phase} {time.time():.3f}\n")


def read_phase(state_dir: str | Path, rank: int | str) -> tuple[str, float]:
    """(phase, wall time it began); ("starting", 0.0) before the rank wrote one."""
    try:
        return phase_of(state_path(state_dir, rank, PHASE).read_bytes())
    except OSError:
        return "starting", 0.0


def phase_of(raw: bytes) -> tuple[str, float]:
    """A phase file's (phase, wall time it began); ("starting", 0.0) for one half written."""
    try:
        phase, stamp = raw.decode().split()
        return phase, float(stamp)
    except (UnicodeDecodeError, ValueError):
        return "starting", 0.0


@dataclass(frozen=True)
class StepCount:
    """The job's optimizer steps as a rank counts them (ddpkit.train.step_count): the loaded
    state's steps, the steps done since, the wall time the first of them ended, whether
    s.load_state found a state, and whether the ranks left wrote it at a failure."""

    base: int
    done: int
    first_end: float
    loaded: bool
    rescued: bool


COUNT_FORMAT = struct.Struct("<qqd??")


def count_of(raw: bytes) -> StepCount | None:
    """A count record's bytes as read (None where it is not whole yet)."""
    return StepCount(*COUNT_FORMAT.unpack_from(raw)) if len(raw) >= COUNT_FORMAT.size else None


def write_ended(state_dir: str | Path, rank: int | str, code: int) -> None:
    state_path(state_dir, rank, ENDED).write_text(f"{code} {time.time():.3f}\n")


def read_ended(state_dir: str | Path, rank: int | str) -> tuple[int, float] | None:
    """(exit code, wall time) of a rank that ended by itself, as it said; None otherwise."""
    try:
        code, stamp = state_path(state_dir, rank, ENDED).read_text().split()
        return int(code), float(stamp)
    except (OSError, ValueError):
        return None


def write_group(state_dir: str | Path, rank: int | str, backend: str, timeout: float) -> None:
    """What a rank's process group is: its backend and its collectives' timeout (seconds)."""
    data = {"backend": backend, "timeout": timeout}
    state_path(state_dir, rank, GROUP).write_text(json.dumps(data))


def read_group(state_dir: str | Path, rank: int | str) -> tuple[str, float] | None:
    try:
        data = json.loads(state_path(state_dir, rank, GROUP).read_text())
        return str(data["backend"]), float(data["timeout"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class ErrorRecord:
    """A rank's uncaught error, timestamped, so the launcher can tell the root cause from the
    ranks that failed because of it."""

    time: float
    type: str
    message: str
    traceback: str = ""
    exit_code: int | None = None  # the code the rank exits with, when it chose one
    fix: str = ""  # what the user can do, when the rank could tell (ddpkit.rank.hints)
    whole: bool = False  # ddpkit's own sentence (a DdpkitError): shown whole, never cut


class OomFacts(TypedDict, total=False):
    """What a rank's memory held when it ran out (the MEMORY file, JSON; ddpkit.rank.oom_facts
    writes it, ddpkit.launch.oom_verdict reads it). Every figure in bytes."""

    kind: str  # "cuda" or "host"
    asked: int | None  # what the failing allocation asked for
    world_size: int
    params: int  # parameters, gradients and optimizer state on the device, each tensor once
    grads: int
    optimizer: int
    grads_expected: int  # at the step's peak: every trainable parameter's gradient
    optimizer_expected: int  # the optimizer's state once it has stepped
    fp32: bool  # the parameters are mostly float32
    blocks: int  # the most repeated blocks in one container (a transformer's layers)
    phase: str  # forward, backward, optimizer or ""
    batch: int | None  # the failing forward's batch (or the loader's)
    batch_from: str  # "forward" or "loader"
    device: int  # the GPU's index
    free: int
    total: int
    allocated: int
    reserved: int
    allowed: int  # the process's own ceiling (set_per_process_memory_fraction)
    peak_allocated: int
    others: int | None  # other processes on the GPU (NVML); None on the host
    bound: str  # what bounds host memory, in words: the machine, the cgroup, ulimit -v
    bound_kind: str  # the same as a value: "machine", "cgroup" or "address_space"
    grew: list[int]  # [first step, last step, allocated then, allocated at the last] of a leak


def write_error(state_dir: str | Path, rank: int | str, record: ErrorRecord) -> None:
    state_path(state_dir, rank, ERROR).write_text(json.dumps(record.__dict__))


def read_error(state_dir: str | Path, rank: int | str) -> ErrorRecord | None:
    try:
        data = json.loads(state_path(state_dir, rank, ERROR).read_text())
        return ErrorRecord(**{k: data[k] for k in data if k in ErrorRecord.__annotations__})
    except (OSError, ValueError, TypeError):
        return None


# -- the progress record ----------------------------------------------------------------------
# A few hundred bytes in a memory-mapped file per rank. The rank writes how many collectives
# it has finished, whether it is inside one now (which, since when, called from which
# file:line, with which shapes), and a beat counter that ddpkit's loader and helpers bump.
# Writes are a struct pack into shared memory (about a microsecond); a read may see a record
# mid-update, which only delays a verdict by one sample. A thread of the rank's writes the wall
# time every TICK_EVERY s: a tick that stops while the rank burns CPU means some C code holds
# the GIL (no Python thread can run), so that CPU time is not progress.

_RECORD = struct.Struct("<QQdB7x32s96s160sdd48sB7x")
RECORD_SIZE = _RECORD.size
BEATS_OFFSET = 8
TICK_OFFSET = 320  # after finished, beats, since, inside (padded), op, shapes, site
STILL_OFFSET = TICK_OFFSET + 8
GPU_OFFSET = STILL_OFFSET + 8
PROMPT_OFFSET = GPU_OFFSET + 48
TICK_EVERY = 0.5  # seconds between the rank's ticks


@dataclass(frozen=True)
class Record:
    finished: int = 0  # collectives completed
    beats: int = 0  # ddpkit helper activity (loader batches, ...)
    since: float = 0.0  # wall time the current collective started
    in_collective: bool = False
    op: str = ""
    shapes: str = ""
    site: str = ""  # file:line of the user's call
    ticked: float = 0.0  # wall time of the rank's last tick (0: it does not tick)
    # wall time since which the script's thread has stood at one place (one call into C: a
    # GPU sync, a blocking read); 0 while it moves
    still: float = 0.0
    gpu: str = ""  # the UUID of the GPU the rank uses, once it uses one ("" on the CPU)
    prompt: bool = False  # the script's thread is at a debugger's prompt (pdb, breakpoint())


class RecordWriter:
    """The rank's side of its progress record."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            self._map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self.finished = 0
        self.beats = 0
        self.ticked = 0.0
        self._write(False, "", "", "", 0.0)

    def _write(self, inside: bool, op: str, shapes: str, site: str, since: float) -> None:
        # the tick thread's fields (ticked, still, gpu) are its own: never written here
        self._map[:TICK_OFFSET] = _RECORD.pack(
            self.finished,
            self.beats,
            since,
            inside,
            op.encode()[:32],
            shapes.encode()[:96],
            site.encode()[:160],
            0.0,
            0.0,
            b"",
            False,
        )[:TICK_OFFSET]

    def tick(self, still: float = 0.0, prompt: bool = False) -> None:
        """The rank's Python threads run (called by its tick thread); `still`: since when the
        script's thread has stood at one place, 0 while it moves; `prompt`: it is at a
        debugger's prompt."""
        self.ticked = time.time()
        struct.pack_into("<dd", self._map, TICK_OFFSET, self.ticked, still)
        struct.pack_into("B", self._map, PROMPT_OFFSET, prompt)

    def set_gpu(self, uuid: str) -> None:
        struct.pack_into("48s", self._map, GPU_OFFSET, uuid.encode()[:48])

    def enter(self, op: str, shapes: str, site: str) -> None:
        self._write(True, op, shapes, site, time.time())

    def leave(self, op: str, shapes: str, site: str) -> None:
        self.finished += 1
        self._write(False, op, shapes, site, 0.0)

    def beat(self) -> None:
        self.beats += 1
        struct.pack_into("<Q", self._map, BEATS_OFFSET, self.beats)


def read_record(state_dir: str | Path, rank: int | str) -> Record | None:
    """The launcher's side: the record, or None before the rank created it."""
    try:
        raw = state_path(state_dir, rank, PROGRESS).read_bytes()
    except OSError:
        return None
    return record_of(raw)


def record_of(raw: bytes) -> Record | None:
    """A progress record's fields, or None for a file not yet its size."""
    if len(raw) < RECORD_SIZE:
        return None
    fields = _RECORD.unpack(raw[:RECORD_SIZE])
    finished, beats, since, inside, op, shapes, site, ticked, still, gpu, prompt = fields
    return Record(
        finished,
        beats,
        since,
        bool(inside),
        _text(op),
        _text(shapes),
        _text(site),
        ticked,
        still,
        _text(gpu),
        bool(prompt),
    )


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


# -- the step record ----------------------------------------------------------------------------
# Every step of the rank, timed (ddpkit.rank.steps), in a memory-mapped ring per rank: a header
# (how many steps were written, the device) and the last STEP_RING steps, each its end (wall
# clock) and seconds: the whole step, waiting for data, computing, waiting for communication,
# and the rest of the host's time. The launcher reads what is new since its last read.

STEPS = "steps"  # the rank's step record
STEP_RING = 1024
# magic, steps written, 1 on a GPU, its UUID; then the GPU memory torch holds at the last step's
# end (allocated, the peak allocated so far, reserved; 0 on the CPU)
_STEPS_HEAD = struct.Struct("<4sQB3x48sQQQ")
_MEMORY = struct.Struct("<QQQ")
_MEMORY_OFFSET = _STEPS_HEAD.size - _MEMORY.size
_STEP = struct.Struct("<Qd5f4x")  # step number, end (time.time()), total, data, compute, comm, host
STEPS_MAGIC = b"DKS1"
_STEPS_COUNT = struct.Struct("<Q")
_COUNT_OFFSET = 4  # the count's place in the header, after the magic
STEPS_SIZE = _STEPS_HEAD.size + STEP_RING * _STEP.size


@dataclass(frozen=True)
class Step:
    number: int  # the rank's step count (1 = its first timed step)
    end: float  # wall clock when it ended
    total: float  # seconds, end to end (optimizer step to optimizer step)
    data: float  # waiting for the next batch
    compute: float  # the rank's own work (on a GPU: timed on the GPU, waits left out)
    comm: float  # waiting for communication (what overlap did not hide)
    host: float  # the rest (on a GPU: the GPU idle, waiting for the host)


class StepWriter:
    """The rank's side of its step record."""

    def __init__(self, path: Path, gpu_uuid: str = "") -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, STEPS_SIZE)
            self._map = mmap.mmap(fd, STEPS_SIZE)
        finally:
            os.close(fd)
        self.count = 0
        self._gpu = gpu_uuid.encode()[:48]
        self._head()

    def _head(self) -> None:
        _STEPS_HEAD.pack_into(
            self._map, 0, STEPS_MAGIC, self.count, bool(self._gpu), self._gpu, 0, 0, 0
        )

    def set_memory(self, allocated: int, peak: int, reserved: int) -> None:
        """The GPU memory torch holds as a step ends (the memory doctor's figures)."""
        _MEMORY.pack_into(self._map, _MEMORY_OFFSET, allocated, peak, reserved)

    def set_gpu(self, uuid: str) -> None:
        self._gpu = uuid.encode()[:48]
        self._head()

    def write(self, step: Step) -> None:
        self.write_values(
            step.number, step.end, step.total, step.data, step.compute, step.comm, step.host
        )

    def write_values(self, *values: float) -> None:
        """A step as its seven fields (Step's order), without making a Step: the rank's hot path."""
        slot = _STEPS_HEAD.size + (self.count % STEP_RING) * _STEP.size
        _STEP.pack_into(self._map, slot, *values)
        self.count += 1
        # the count last: a reader never takes a slot before it is written
        _STEPS_COUNT.pack_into(self._map, _COUNT_OFFSET, self.count)


@dataclass(frozen=True)
class StepRecord:
    count: int  # steps written so far
    gpu: str  # the GPU's UUID ("" on the CPU)
    steps: list[Step]  # the ones asked for that the ring still holds, oldest first
    # GPU bytes at the last step: allocated, peak, reserved
    memory: tuple[int, int, int] = (0, 0, 0)


def read_steps(state_dir: str | Path, rank: int | str, since: int = 0) -> StepRecord | None:
    """The launcher's side: steps numbered above `since` (at most the ring's last STEP_RING),
    or None before the rank made its record."""
    try:
        raw = state_path(state_dir, rank, STEPS).read_bytes()
    except OSError:
        return None
    if len(raw) < STEPS_SIZE:
        return None
    magic, count, on_gpu, uuid, allocated, peak, reserved = _STEPS_HEAD.unpack_from(raw, 0)
    if magic != STEPS_MAGIC:
        return None
    first = max(since, count - STEP_RING + 1, 0)  # the oldest the ring still holds
    steps = []
    for n in range(first, count):
        slot = _STEPS_HEAD.size + (n % STEP_RING) * _STEP.size
        step = Step(*_STEP.unpack_from(raw, slot))
        if step.number == n + 1:  # not overwritten while we read
            steps.append(step)
    return StepRecord(count, _text(uuid) if on_gpu else "", steps, (allocated, peak, reserved))


# The torch.distributed calls the rank records (the outermost call only: all_gather_object's
# own all_gather is part of it), and that the hang doctor recognises in a stack.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_reduce_coalesced", "batch_isend_irecv",
)  # fmt: skip
