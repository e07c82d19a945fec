"""Write ``docs/layout.md``, the map of the repository, from dyncp's package and module docstrings.

    python tools/layout_page.py           # write the page
    python tools/layout_page.py --check   # exit 1 if the page is not what it would write

A hand-kept map goes stale as modules come and go; this one is the first line of each module's
docstring (which says what the module is), grouped by package in the layer order below, so the
page changes exactly when the code does and ``tests/unit/test_layout_page.py`` fails until it is
written again. The source is read, not imported (no torch needed). The layer order and the
top-level folders are stated here once: ``tests/unit/test_layering.py`` checks the imports
against the same ``LAYERS`` and ``TORCH_FREE``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "layout.md"
COMMAND = "python tools/layout_page.py"

#: dyncp's packages, low to high: a module imports its own package, a package of its own layer or
#: of a lower one. ``testing`` (test helpers) is on top and imported by no library module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("plan", "data"),
    ("cost_model",),
    ("planner",),
    ("observability", "sim"),
    ("control",),
    ("ring_attention", "ssm"),
    ("runtime",),
    ("service",),
    ("sampler",),
    ("integrations", "profiling"),
    ("testing",),
)
#: Packages that import no torch (nor transformers, accelerate, trl), not even lazily: the planner
#: and ``python -m dyncp.sim`` run on a machine without torch.
TORCH_FREE = ("plan", "data", "cost_model", "planner", "observability", "sim")

#: The repository's top-level folders (``dyncp/`` is the rest of the page).
FOLDERS: dict[str, str] = {
    "dyncp/": "the library: the packages below",
    "tests/": (
        "pytest, in tiers by folder: `tests/unit/<package>/` (one process, by package), "
        "`tests/multirank/` (spawned gloo processes; marker `multirank`), `tests/examples/` "
        "(the example scripts end to end; marker `examples`); shared helpers in `tests/support/`, "
        "importable by name"
    ),
    "bench/": (
        "benchmarks and reproductions, not part of the test run (`megatron_repro.py` the "
        "published table, `gpu_check.py` the one-command GPU check, `plan_digests.py` plans "
        "digest for digest)"
    ),
    "examples/": "training scripts: `train_tiny.py` (torchrun), `train_hf.py`, `sft.py`, "
    "`grpo_rollouts.py`",
    "results/": (
        "the simulator's JSON reports behind the tables of the reproductions pages "
        "(formerly `sim/results/`)"
    ),
    "dashboards/": "Grafana dashboard, Prometheus recording rules and alerts (with promtool tests)",
    "docs/": "this site (MkDocs with `mkdocs.yml`; the API reference generated from docstrings)",
    "tools/": "scripts that keep the repository true: `layout_page.py` writes this page",
    ".ci/": "`.ci/run`, the CI job on a clean checkout: the installs, a wheel, the docs, the tests",
}


def first_line(path: Path) -> str | None:
    """The first line of a file's docstring, as Markdown (``:mod:`x``` becomes `` `x` ``)."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    if not doc:
        return None
    line = doc.strip().splitlines()[0].strip()
    return re.sub(r":\w+:`([^`]+)`", r"`\1`", line).replace("|", "\\|")


def packages(pkg: Path) -> list[Path]:
    """Every package folder (one with ``__init__.py``) under and including ``pkg``."""
    return sorted(p.parent for p in pkg.rglob("__init__.py"))


def _rank(package: str) -> tuple[int, int, str]:
    top = package.split(".")[1] if "." in package else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return (i + 1, names.index(top), package)
    return (0, 0, package)  # the root package, and anything not in LAYERS, first


def _data_row(folder: Path) -> str:
    """A package-data folder: its kinds of files, and the first line of each script in it."""
    kinds = sorted({f"*{f.suffix}" for f in folder.iterdir() if f.is_file() and f.suffix != ".py"})
    text = "package data (" + ", ".join(f"`{k}`" for k in kinds) + ")"
    for script in sorted(folder.glob("*.py")):
        text += f"; `{script.name}`: {first_line(script) or '(no docstring)'}"
    return f"| `{folder.name}/` | {text} |"


def render(root: Path = ROOT) -> str:
    pkg = root / "dyncp"
    out = [
        "# Layout",
        "",
        "Every package and module of dyncp with the first line of its docstring, in the layer",
        f"order. Written by `{COMMAND}` from the docstrings: edit those, then run it",
        "(`tests/unit/test_layout_page.py` fails when this page is not what it writes).",
        "",
        "## The repository",
        "",
        "| Folder | What it holds |",
        "| --- | --- |",
        *(f"| `{name}` | {text} |" for name, text in FOLDERS.items()),
        "",
        "## Layers",
        "",
        "Low to high: a module imports its own package, a package of its layer or of a lower one,",
        "never a higher one, and no import circle (also not through imports inside functions);",
        "`tests/unit/test_layering.py` checks it. The torch-free packages import no torch, not",
        "even lazily; `dyncp._compat` (the import paths of dyncp 0.1) stands outside the layers.",
        "",
    ]
    for i, names in enumerate(LAYERS, 1):
        marks = [f"`{n}`" + (" (torch-free)" if n in TORCH_FREE else "") for n in names]
        out.append(f"{i}. {', '.join(marks)}")
    out += ["", "## Packages and modules", ""]
    for folder in sorted(packages(pkg), key=lambda p: _rank(_dotted(p, root))):
        name = _dotted(folder, root)
        top = name.split(".")[1] if "." in name else ""
        free = " (torch-free)" if top in TORCH_FREE else ""
        out += [f"### `{name}`{free}", "", first_line(folder / "__init__.py") or "(no docstring)"]
        rows = [
            f"| `{f.stem}` | {first_line(f) or '(no docstring)'} |"
            for f in sorted(folder.glob("*.py"))
            if f.name != "__init__.py"
        ]
        rows += [
            _data_row(d)
            for d in sorted(folder.iterdir())
            # A folder git would not carry (empty, or caches only) is no package data: a fresh
            # clone has no such folder, so the page must not name it.
            if d.is_dir()
            and not (d / "__init__.py").exists()
            and d.name != "__pycache__"
            and any(f.is_file() for f in d.iterdir())
        ]
        if rows:
            out += ["", "| Module | What it is |", "| --- | --- |", *rows]
        out.append("")
    return "\n".join(out)


def _dotted(folder: Path, root: Path) -> str:
    return ".".join(folder.relative_to(root).parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
