"""What this rank tells the launcher, the one way the library and the bootstrap do it: its
progress record (the format is `ddpkit.common.protocol.Record`: written by the bootstrap's
collective wrappers, beaten by ddpkit's helpers and its tick thread, read by the launcher's hang
watch), its phase (started, init, ready) and whether it reads s.stop_requested (graceful).
Outside a worker of `ddpkit run` every call here does nothing."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from ddpkit.common import protocol
from ddpkit.rank import runtime


@dataclass
class Progress:
    """The rank's progress record, opened at first use: a part of its runtime."""

    writer: protocol.RecordWriter | None = None
    opened: bool = False


def writer() -> protocol.RecordWriter | None:
    """This process's writer when it is a rank started by ddpkit run (else None)."""
    here = runtime.current()
    progress = here.part(Progress)
    if not progress.opened:
        progress.opened = True
        # only the rank itself: a DataLoader worker inherits the variables but is not the rank
        if here.is_rank():
            try:
                progress.writer = protocol.RecordWriter(here.path(protocol.PROGRESS))
            except OSError:
                progress.writer = None
    return progress.writer


def beat() -> None:
    """Tell the launcher this rank is making progress (called by ddpkit's helpers)."""
    w = writer()
    if w is not None:
        w.beat()


def start_ticking() -> None:
    """A thread that ticks the record every protocol.TICK_EVERY s while Python threads can run:
    the launcher tells a rank stuck in C code holding the GIL from one that computes. Each tick
    also says since when the script's thread has stood at one place (the same frame at the
    same instruction: one call into C, such as a wait for the GPU) and, once the rank uses a
    GPU, which one: a rank whose GPU never finishes spins a core in CUDA's wait, and the
    launcher must not count that as progress."""
    w = writer()
    if w is None:
        return
    main = threading.main_thread().ident
    answering = _watch_input()

    def tick() -> None:
        at: tuple[int, int, int] | None = None
        since = 0.0
        gpu: int | None = None
        while True:
            frame = sys._current_frames().get(main) if main is not None else None
            # a loop whose time goes to one sync (loss.item()) is sampled at the same place
            # every time: the GPU allocations it makes each step tell it from a wait that
            # never ends
            here = (id(frame), frame.f_lasti, _allocations(gpu)) if frame is not None else None
            prompt = _at_prompt(frame) or answering[0] > 0
            del frame
            now = time.time()
            if here is None or here != at:
                at, since = here, now
            w.tick(since if now - since >= protocol.TICK_EVERY * 1.5 else 0.0, prompt)
            if gpu is None:
                gpu = _tell_gpu(w)
            time.sleep(protocol.TICK_EVERY)

    threading.Thread(target=tick, daemon=True, name="ddpkit-tick").start()


def _watch_input() -> list[int]:
    """input() wrapped so that the tick says the rank is at a prompt while the script waits in
    it for a person (a terminal given with --stdin): waiting for a person is no hang. The
    returned list holds how many calls wait in it now."""
    import builtins

    waiting = [0]
    original = builtins.input

    def input(prompt: object = "") -> str:  # noqa: A001 - it stands in for the builtin
        waiting[0] += 1
        try:
            return original(prompt)
        finally:
            waiting[0] -= 1

    builtins.input = input
    return waiting


def _at_prompt(frame: object) -> bool:
    """The script's thread is inside a debugger (pdb, breakpoint(), ipdb: bdb's frames)."""
    if "bdb" not in sys.modules:
        return False
    while frame is not None:
        if frame.f_code.co_filename.endswith("bdb.py"):  # type: ignore[attr-defined]
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False


def _allocations(index: int | None) -> int:
    """How many allocations torch's CUDA allocator has served on GPU `index` (its own
    bookkeeping: no call into the driver)."""
    if index is None or index < 0:
        return 0
    try:
        torch = sys.modules["torch"]
        stats = torch.cuda.memory_stats_as_nested_dict(index)
        return int(stats["allocation"]["all"]["allocated"])
    except Exception:
        return 0


def _tell_gpu(w: protocol.RecordWriter) -> int | None:
    """Once the rank holds memory on a GPU: write that GPU's UUID into the record and return
    its index (-1 when it cannot be told). Only torch's own bookkeeping is read until then."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not getattr(cuda, "_initialized", False):
        return None
    try:
        used = [i for i in range(cuda.device_count()) if cuda.memory_allocated(i) > 0]
        if not used:
            return None
        w.set_gpu(str(cuda.get_device_properties(used[0]).uuid))
    except Exception:
        return -1  # never try again: a hint must not cost the rank
    return used[0]


def _state_dir() -> tuple[str, str] | None:
    here = runtime.current()
    return (here.state_dir, here.rank_name) if here.state_dir else None


def set_phase(phase: str) -> None:
    """Where this rank is in start-up: started, init (waiting for its peers), ready."""
    where = _state_dir()
    if where is not None:
        try:
            protocol.write_phase(where[0], where[1], phase)
        except OSError:
            pass


def write_modules() -> None:
    """The modules this rank imported from installed packages (the standard library, site
    packages; not ddpkit, not the script's own), one a line in import order: a warm spare of
    the next attempt imports them before it is needed (ddpkit.launch.spares)."""
    where = _state_dir()
    if where is None:
        return
    import site
    import sysconfig

    roots = tuple(
        {*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["stdlib"]}
    )
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(roots) and not name.startswith(("ddpkit", "__main__", "__mp_main__")):
            names.append(name)
    try:
        protocol.state_path(where[0], where[1], protocol.MODULES).write_text("\n".join(names))
    except OSError:
        pass


def mark_graceful() -> None:
    """This rank reads s.stop_requested: after forwarding a stop signal the launcher gives it
    time to save before it kills."""
    where = _state_dir()
    if where is not None:
        try:
            protocol.state_path(where[0], where[1], protocol.GRACEFUL).touch()
        except OSError:
            pass
