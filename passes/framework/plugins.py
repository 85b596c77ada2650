"""Passes from outside kvc, so a compiler engineer can run and bisect their own.

* a Python file: `kvc compile|bisect|passes --pass-plugin my_pass.py` imports it; the file
  registers its passes with `@register_pass` (docs/writing-a-pass.md);
* an installed package: an entry point in the group ``kvc.passes`` names a module (or any
  object) whose import registers the passes; `kvc.passes.load_all` loads them all.

A plugin that cannot be imported (whatever it raises, `sys.exit` too), or that registers
nothing, is a UsageError naming the file and the reason; its traceback is not shown. A plugin's
pass that raises, exits or returns something else than a PassResult when it runs is a
PassFailure naming the pass and its file (`PassManager.run`), not an internal error of kvc's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from kvc.errors import UsageError
from kvc.passes.framework import registry

ENTRY_POINT_GROUP = "kvc.passes"


def load_plugin(path: str | Path) -> list[str]:
    """Import a Python file that registers passes; the names it registered."""
    path = Path(path).resolve()
    if not path.is_file() or path.suffix != ".py":
        raise UsageError(f"pass plugin {path}: expected an existing .py file")
    module_name = "kvc_plugin_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:  # the same file twice: already registered
        return sorted(getattr(sys.modules[module_name], "__kvc_passes__", []))
    registry.registered()  # kvc's own passes first, so a clash names the plugin
    before = set(registry.registered())
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error in foreign code is the plugin's
        # (a sys.exit(0) at import ended `kvc compile` with status 0, no OUT and no message)
        del sys.modules[module_name]
        raise UsageError(f"pass plugin {path} failed to import: {exc.__class__.__name__}: {exc}") from None
    added = sorted(set(registry.registered()) - before)
    if not added:
        del sys.modules[module_name]
        raise UsageError(f"pass plugin {path} registered no pass (decorate a Pass subclass with "
                         f"@kvc.passes.framework.registry.register_pass)")
    module.__kvc_passes__ = added
    return added


def load_entry_points() -> list[str]:
    """Load every installed ``kvc.passes`` entry point; the names of what was loaded."""
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"pass plugin entry point {ep.name} = {ep.value} failed to load: "
                             f"{exc.__class__.__name__}: {exc}") from None
        loaded.append(ep.name)
    return loaded
