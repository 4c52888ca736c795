"""Run a function on some of torch's modules right after they are imported (by the script, or
by `import torch` itself): the init watch, the sampler watch and the step timing hook in there.
Importing this module imports no torch."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any


class ImportWatcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a function on some of torch's modules right after they are imported (by the
    script, or by `import torch` itself), to watch init and time steps. No torch import is
    triggered by this."""

    def __init__(self) -> None:
        from ddpkit.rank import init_watch, loader_watch, sampler_watch, spawn_watch, steps

        def watch_dataloader(module: ModuleType) -> None:
            steps.patch_dataloader(module)  # time each batch
            loader_watch.patch_loader(module)  # say when every rank has all of the data

        self.targets = {
            "torch.distributed.distributed_c10d": init_watch.patch_init,
            "torch.utils.data.distributed": sampler_watch.patch_sampler,
            "torch.autograd": steps.patch_backward,
            "torch.optim.optimizer": steps.install_optimizer_hooks,
            "torch.utils.data.dataloader": watch_dataloader,
            "torch.multiprocessing.spawn": spawn_watch.patch_spawn,  # a launch in a launch
        }

    def watch_loaded(self) -> None:
        """The modules already imported (a warm spare imported torch before it took its
        place: ddpkit.rank.spare): their functions run now. A function a module replaced is
        replaced too where its package re-exported it (torch.distributed.init_process_group)."""
        for name in [n for n in self.targets if n in sys.modules]:
            module, after = sys.modules[name], self.targets.pop(name)
            before = dict(vars(module))
            try:
                after(module)
            except Exception as err:  # never break the script's torch
                from ddpkit.errors import debug_note

                debug_note(f"watching {name}", err)
                continue
            changed = {k: v for k, v in vars(module).items() if before.get(k, v) is not v}
            parts = name.split(".")
            for depth in range(1, len(parts)):
                package = sys.modules.get(".".join(parts[:depth]))
                for key, new in changed.items():
                    if package is not None and getattr(package, key, None) is before[key]:
                        setattr(package, key, new)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        after = self.targets.pop(name, None)
        if after is None:
            return None
        if not self.targets:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner, then = spec.loader, after

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> ModuleType | None:
                return inner.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                inner.exec_module(module)
                try:
                    then(module)
                except Exception as err:  # never break the script's import of torch
                    from ddpkit.errors import debug_note

                    debug_note(f"watching {module.__name__}", err)

        spec.loader = Loader()
        return spec
