"""The import paths of dyncp 0.1's flat layout, kept for one release.

dyncp 0.2 moved its loose top-level modules into packages that read as the data flow
(``docs/layout.md``). So that code written against 0.1 keeps running, each old path is an alias:
``import dyncp.plan_auth`` gives the module ``dyncp.control.signing`` itself (the same object, so
a monkeypatch through either name is seen by both), with a ``DeprecationWarning`` naming the new
path; ``python -m dyncp.serve`` runs ``dyncp.service.cli``. An old path whose names now live in
two modules (``dyncp.calibration``) gives a module that looks each name up in them in turn.

One finder on ``sys.meta_path`` does it, instead of a shim file per old path that would keep the
top level flat; ``dyncp/__init__.py`` installs it (once per process: an already installed finder
is kept). Remove the table, and this module, in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

#: old module -> the new module(s) its names live in (the first is the one ``-m`` runs).
MOVED: dict[str, tuple[str, ...]] = {
    "dyncp.agreement": ("dyncp.control.agreement",),
    "dyncp.calibration": ("dyncp.cost_model.calibration.online", "dyncp.planner.versioned"),
    "dyncp.datasets": ("dyncp.data.readers",),
    "dyncp.menu": ("dyncp.plan.menu",),
    "dyncp.metrics": (
        "dyncp.observability.metrics",
        "dyncp.observability.exporter",
        "dyncp.observability.catalog",
    ),
    "dyncp.model_channel": ("dyncp.control.model_channel",),
    "dyncp.plan_auth": ("dyncp.control.signing",),
    "dyncp.plan_slice": ("dyncp.plan.slice",),
    "dyncp.serve": ("dyncp.service.cli",),
    "dyncp.cost_model.calibrate": ("dyncp.cost_model.calibration.fit",),
    "dyncp.cost_model.calibrate_mix": ("dyncp.cost_model.calibration.mix",),
    "dyncp.cost_model.level": ("dyncp.cost_model.calibration.level",),
    "dyncp.cost_model.measurements": ("dyncp.cost_model.calibration.measurements",),
    "dyncp.runtime.failures": ("dyncp.control.failures",),
}

__all__ = ["MOVED", "install"]


class _Union(types.ModuleType):
    """An old module whose names now live in several new modules: each looked up in turn."""

    def __init__(self, name: str, targets: Sequence[types.ModuleType]) -> None:
        super().__init__(name, f"Deprecated alias of {', '.join(t.__name__ for t in targets)}.")
        self._targets = tuple(targets)

    def __getattr__(self, attr: str) -> object:
        for target in self._targets:
            if hasattr(target, attr):
                return getattr(target, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(t)})


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: tuple[str, ...]) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{self.old} moved to {' and '.join(self.new)}; the old path goes in dyncp 0.3",
            DeprecationWarning,
            stacklevel=4,
        )
        targets = [importlib.import_module(n) for n in self.new]
        return targets[0] if len(targets) == 1 else _Union(self.old, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module was imported under its new name."""

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The new module's code, for ``python -m <old path>`` (runpy asks the loader)."""
        spec = importlib.util.find_spec(self.new[0])
        return spec.loader.get_code(self.new[0])  # type: ignore[union-attr]


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` unless one is there already."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
