"""A warm spare imported torch before its rank's watches were set (ddpkit.rank.import_hooks):
the watches run on the modules already loaded, and a function a module's watch replaced is
replaced where its package re-exported it too (as torch.distributed re-exports
init_process_group)."""

from __future__ import annotations

import sys

from ddpkit.rank.import_hooks import ImportWatcher


def test_a_loaded_modules_watch_runs_and_reaches_its_packages_re_export(tmp_path, monkeypatch):
    package = tmp_path / "pkg_spare"
    package.mkdir()
    (package / "sub.py").write_text("def init():\n    return 'original'\n")
    (package / "__init__.py").write_text("from .sub import init\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import pkg_spare  # noqa: F401 - loaded before the watcher, as in a spare

    def watch(module):
        original = module.init
        module.init = lambda: f"watched {original()}"

    watcher = ImportWatcher()
    watcher.targets = {"pkg_spare.sub": watch, "not.loaded.yet": watch}
    watcher.watch_loaded()
    assert sys.modules["pkg_spare.sub"].init() == "watched original"
    assert sys.modules["pkg_spare"].init() == "watched original", "the re-export follows"
    assert list(watcher.targets) == ["not.loaded.yet"], "left for find_spec"
    for name in ("pkg_spare", "pkg_spare.sub"):
        sys.modules.pop(name, None)
