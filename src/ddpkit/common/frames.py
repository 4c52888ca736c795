"""Which frames of a stack are the user's: library code is recognised by the directories torch,
ddpkit and the standard library are installed in, never by words in a path. And a stack as
faulthandler writes it, read as frames: its threads, the script's thread, the frames a report
shows, the line of the user's code it stands at.

A project cloned into a folder named `ddpkit` or `torch`, or a script in `.../runpy_tests/`,
is the user's code like any other. Nothing here imports torch (its folder is found with
importlib's finder, which does not run it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sysconfig
from dataclasses import dataclass


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations))) + os.sep


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.lru_cache(maxsize=1)
def _site_dirs() -> tuple[str, ...]:
    """Where installed packages live: this environment's and the interpreter's site folders,
    the user's, and Debian's dist-packages."""
    import site

    paths = sysconfig.get_paths()
    found = {paths[k] for k in ("purelib", "platlib")}
    try:
        found.update(site.getsitepackages())
        found.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return tuple({os.path.realpath(p) + os.sep for p in found if p})


# the package folder (this file is in ddpkit/common/)
DDPKIT_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
EXAMPLES_DIR = DDPKIT_DIR + "examples" + os.sep
BOOTSTRAP = DDPKIT_DIR + os.path.join("rank", "bootstrap.py")


@functools.lru_cache(maxsize=1)
def _torch_dir() -> str | None:
    return _package_dir("torch")


@functools.lru_cache(maxsize=4096)
def owner(filename: str) -> str | None:
    """ "torch", "ddpkit" or "python" (the standard library, the interpreter's frozen modules)
    for library code; None for the user's own code (ddpkit's bundled examples included)."""
    if filename.startswith("<frozen "):
        return "python"
    path = os.path.realpath(filename)
    if path.startswith(EXAMPLES_DIR):
        return None
    if path.startswith(DDPKIT_DIR):
        return "ddpkit"
    torch_dir = _torch_dir()
    if torch_dir is not None and path.startswith(torch_dir):
        return "torch"
    if path.startswith(_stdlib_dirs()) and not path.startswith(_site_dirs()):
        return "python"
    return None


def is_framework(filename: str) -> bool:
    """Installed third-party code (Lightning, Hugging Face, Accelerate...): the user's training
    runs inside it, but the user's own lines are elsewhere."""
    if owner(filename) is not None or filename.startswith("<"):
        return False
    return os.path.realpath(filename).startswith(_site_dirs())


def is_library(filename: str) -> bool:
    """Frames of torch, ddpkit itself (not its examples) and the standard library: what a user
    does not need to read in a stack."""
    return owner(filename) is not None


def torch_module(filename: str) -> str | None:
    """The path of a torch source file inside torch's folder ('distributed/distributed_c10d.py'),
    or None when the file is not torch's."""
    torch_dir = _torch_dir()
    path = os.path.realpath(filename)
    if torch_dir is None or not path.startswith(torch_dir):
        return None
    return path[len(torch_dir) :].replace(os.sep, "/")


def is_bootstrap(filename: str) -> bool:
    """The frame that runs the user's script inside a worker started by `ddpkit run`."""
    return os.path.realpath(filename) == BOOTSTRAP


# -- a stack as faulthandler writes it, read as frames ----------------------------------------


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def site(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.site} in {self.func}"


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$', re.M)


def parse_threads(text: str) -> list[list[Frame]]:
    """faulthandler's dump -> one list of frames (innermost first) per thread."""
    starts = [m.start() for m in _THREAD.finditer(text)] + [len(text)]
    threads = []
    for begin, end in zip(starts, starts[1:], strict=False):
        frames = [Frame(f, int(n), fn.strip()) for f, n, fn in _FRAME.findall(text[begin:end])]
        if frames:
            threads.append(frames)
    return threads


def main_thread(threads: list[list[Frame]]) -> list[Frame]:
    """The thread running the user's script: its outermost frames are the bootstrap's."""
    for frames in threads:
        if any(is_bootstrap(f.file) for f in frames[-4:]):
            return frames
    return threads[0] if threads else []


def user_frames(frames: list[Frame]) -> list[Frame]:
    """Frames outside torch, ddpkit and Python: the script's, and the frameworks' it runs in."""
    return [f for f in frames if not is_library(f.file)]


def scripts_frames(frames: list[Frame]) -> list[Frame]:
    """The user's own frames: not library code, nor an installed framework's."""
    return [f for f in frames if not is_library(f.file) and not is_framework(f.file)]


def shown_frames(frames: list[Frame], inner: int = 6) -> list[str]:
    """The frames a report shows of a stack, innermost first: the innermost outside torch,
    ddpkit and Python, and every frame of the script's own (a framework's loop can be deep)."""
    outside = user_frames(frames)
    script = set(map(id, scripts_frames(frames)))
    shown = [str(f) for f in outside[:inner]]
    rest = [f for f in outside[inner:] if id(f) in script]
    if rest:
        skipped = len(outside) - inner - len(rest)
        shown += [f"... {skipped} frame(s) of installed packages"] if skipped else []
        shown += [str(f) for f in rest]
    return shown


def code_site(frames: list[Frame]) -> str:
    """Where in the user's code a stack stands: the innermost line of the script; inside a
    framework (Lightning, Trainer), the framework's innermost line and the script's line that
    called into it ('trainer.py:123 in _inner_loop, from train.py:40')."""
    outside = user_frames(frames)
    if not outside:
        return "?"
    innermost = outside[0]
    if not is_framework(innermost.file):
        return innermost.site
    script = scripts_frames(frames)
    return f"{innermost} from {script[0].site}" if script else str(innermost)
