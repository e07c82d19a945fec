"""The import paths of dyncp 0.1's flat layout, kept for one release.

dyncp 0.2 moved its loose top-level modules into packages that read as the data flow
(``docs/layout.md``). So that code written against 0.1 keeps running, each old path is an alias:
``import dyncp.plan_auth`` gives the module ``dyncp.control.signing`` itself (the same object, so
a monkeypatch through either name is seen by both), with a ``DeprecationWarning`` naming the new
path; ``python -m dyncp.serve`` runs ``dyncp.service.cli``. An old path whose names now live in
two modules (``dyncp.calibration``) gives a module that looks each name up in them in turn, and
sets a name (a monkeypatch) in the modules that hold it.

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
    "dyncp.sampler.schedule": ("dyncp.data.schedule",),
    # The planner's modules, in its subpackages since 0.2 (``dyncp.planner``'s docstring).
    "dyncp.planner.assignment": ("dyncp.planner.construction.assignment",),
    "dyncp.planner.bound": ("dyncp.planner.bounds.closed_form", "dyncp.planner.batch"),
    "dyncp.planner.cpsat": ("dyncp.planner.improvement.cpsat",),
    "dyncp.planner.dataflow": ("dyncp.planner.construction.dataflow",),
    "dyncp.planner.deferred": ("dyncp.planner.bounds.deferred",),
    "dyncp.planner.dp_balanced": ("dyncp.planner.baselines.dp_balanced",),
    "dyncp.planner.greedy": ("dyncp.planner.construction.greedy",),
    "dyncp.planner.head_split": ("dyncp.planner.improvement.head_split",),
    "dyncp.planner.laminar": ("dyncp.planner.improvement.laminar",),
    "dyncp.planner.local_search": ("dyncp.planner.construction.local_search",),
    "dyncp.planner.lp_bound": ("dyncp.planner.bounds.lp_bound",),
    "dyncp.planner.megatron": ("dyncp.planner.baselines.megatron",),
    "dyncp.planner.megatron_min_cp": ("dyncp.planner.baselines.megatron_min_cp",),
    "dyncp.planner.packing": ("dyncp.planner.construction.packing",),
    "dyncp.planner.rounding": ("dyncp.planner.bounds.rounding",),
    "dyncp.planner.static": ("dyncp.planner.baselines.static",),
    "dyncp.planner.structure": (
        "dyncp.planner.construction.structure",
        "dyncp.planner.construction.fluid",
    ),
}

__all__ = ["MOVED", "install"]


class _Forward:
    """A name of an old module that now lives in new ones: read from the first that has it, set
    in (or deleted from) each that holds it, as 0.1's one global was seen by all its functions.

    A data descriptor on the alias's class, so that ``setattr`` on the alias reaches the new
    modules and a monkeypatch (which reads the old value back through it) is undone there too.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, alias: _Union | None, owner: type | None = None) -> object:
        if alias is None:
            return self
        return alias.__getattr__(self.name)

    def _holders(self, alias: _Union) -> list[types.ModuleType]:
        return [t for t in alias._targets if self.name in vars(t)] or [alias._targets[0]]

    def __set__(self, alias: _Union, value: object) -> None:
        for target in self._holders(alias):
            setattr(target, self.name, value)

    def __delete__(self, alias: _Union) -> None:
        for target in self._holders(alias):
            delattr(target, self.name)


class _Union(types.ModuleType):
    """An old module whose names now live in several new modules: each looked up in turn.

    Made by :meth:`of`, as an instance of a subclass with a :class:`_Forward` per name of the new
    modules, so that setting a name through the old path sets it where the code reads it.
    """

    _targets: tuple[types.ModuleType, ...]

    @classmethod
    def of(cls, name: str, targets: Sequence[types.ModuleType]) -> _Union:
        names = {n for t in targets for n in vars(t) if not n.startswith("__")} - set(dir(cls))
        kind = type(cls.__name__, (cls,), {n: _Forward(n) for n in sorted(names)})
        alias = kind(name, f"Deprecated alias of {', '.join(t.__name__ for t in targets)}.")
        alias._targets = tuple(targets)
        alias.__all__ = sorted({n for t in targets for n in getattr(t, "__all__", ())})
        return alias

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
        # stacklevel 2 is the importing line: warnings skips the import system's own frames, so
        # the warning is shown by default where ``__main__`` imports an old path.
        warnings.warn(
            f"{self.old} moved to {' and '.join(self.new)}; the old path goes in dyncp 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        targets = [importlib.import_module(n) for n in self.new]
        self._own_spec = targets[0].__spec__
        return targets[0] if len(targets) == 1 else _Union.of(self.old, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module was imported under its new name. The import system has just
        set its ``__spec__`` to the alias's; the module's own is put back."""
        if not isinstance(module, _Union):
            module.__spec__ = self._own_spec

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
