"""A rank of `ddpkit.spawn`: find the function again and call it, as mp.spawn's child does.

The script is imported as `__mp_main__` (and stands as `__main__` too, so that what pickle
names `__main__.X` is found): its `if __name__ == "__main__":` block does not run again. A
function of an importable module is imported from it. Then `fn(local_rank, *args)`, with the
caller's sys.argv, as mp.spawn gives its processes.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import sys
import types
from pathlib import Path
from typing import Any


def run_function(target: str, qualname: str, args_file: str) -> Any:
    # written by the caller of ddpkit.spawn, this same user, in its own 0700 folder
    argv, pickled = pickle.loads(Path(args_file).read_bytes())  # noqa: S301
    sys.argv = list(argv)
    if target.endswith(".py"):
        module = _import_script(target)
    else:
        sys.path.insert(0, os.getcwd())
        import importlib

        module = importlib.import_module(target)
    fn: Any = module
    for name in qualname.split("."):
        fn = getattr(fn, name)
    args = pickle.loads(pickled)  # noqa: S301 - after the script: its classes are found
    return fn(int(os.environ.get("LOCAL_RANK", "0")), *args)


def _import_script(path: str) -> types.ModuleType:
    """The script as mp.spawn's child imports it: `__mp_main__`, also `__main__`."""
    sys.path[0] = os.path.dirname(path)
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, module.__dict__)  # noqa: S102 - the user's script, as mp.spawn's child runs it
    return module
