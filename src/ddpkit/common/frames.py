"""Which frames of a stack are the user's: library code is recognised by the directories torch,
ddpkit and the standard library are installed in, never by words in a path.

A project cloned into a folder named `ddpkit` or `torch`, or a script in `.../runpy_tests/`,
is the user's code like any other. Nothing here imports torch (its folder is found with
importlib's finder, which does not run it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig


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
