"""The import graph of the project's packages: no cycle, and the dependency direction holds.

Every ``import`` statement counts, at module level, inside a function (a function-level
import is still a dependency, it only runs later) or under ``TYPE_CHECKING`` (a type a module
names is a dependency too). Module names come from the folders and
pyproject.toml's ``package-dir`` (``protocols/`` installs as ``foltr_async.protocols``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("foltr_async", "protocols", "benchmarks")


def package_names() -> dict[str, str]:
    """Folder -> the package name it installs as."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = cfg["tool"].get("setuptools", {}).get("package-dir", {})
    by_folder = {folder: name for name, folder in dirs.items()}
    return {folder: by_folder.get(folder, folder) for folder in FOLDERS}


def modules() -> dict[str, Path]:
    """Every module of the three packages by its dotted name."""
    out = {}
    for folder, name in package_names().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def nearest(dotted: str, mods: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (None: not the project's)."""
    while dotted and dotted not in mods:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports(name: str, mods: dict[str, Path]) -> set[str]:
    """The project modules module ``name`` imports anywhere in its file.

    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``; a package
    named only as the parent of an imported module is no edge (executing its ``__init__``
    first is Python's business, not a dependency of this module)."""
    path = mods[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(nearest(alias.name, mods) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in mods else nearest(base, mods))
    return out - {None, name}


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    mods = modules()
    return {name: imports(name, mods) for name in mods}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=len, reverse=True)


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles (largest first): " + "; ".join(
        f"{len(c)} modules: {', '.join(c)}" for c in found
    )


def test_runtime_and_ltr_never_import_protocols():
    protocols = package_names()["protocols"]
    bad = {
        f"{m} -> {t}"
        for m, ts in graph().items()
        if m.startswith(("foltr_async.runtime.", "foltr_async.ltr."))
        or m in ("foltr_async.runtime", "foltr_async.ltr")
        for t in ts
        if t == protocols or t.startswith(protocols + ".")
    }
    assert not bad, sorted(bad)


def test_protocols_stand_on_the_contract_not_the_orchestrator():
    """A protocol uses ``foltr_async.contract`` (re-exported by its ``api``); the modules that
    drive runs and load protocols are above it."""
    protocols = package_names()["protocols"]
    above = ("foltr_async.simulation", "foltr_async.plugins", "foltr_async.cli")
    bad = {
        f"{m} -> {t}"
        for m, ts in graph().items()
        if m == protocols or m.startswith(protocols + ".")
        for t in ts
        if t in above
    }
    assert not bad, sorted(bad)


def test_validation_imports_no_protocol():
    """``validate`` looks names up in the registry as loaded; loading is the entry point's
    (``load_scenario``, the CLI, workers), so validation never imports the protocols."""
    names = ("protocols", package_names()["protocols"])
    code = (
        "import sys\n"
        "from foltr_async.errors import ScenarioError\n"
        "from foltr_async.scenario.load import validate\n"
        "try:\n"
        "    validate({'federation': {'protocol': 'fpdgd'}}, 'x.toml')\n"
        "except ScenarioError as e:\n"
        "    print(e)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({names})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "x.toml: federation.protocol: unknown protocol 'fpdgd': no protocols are registered "
        "(call load_plugins() first)",
        "[]",
    ]


def test_every_package_folder_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        name for name, path in modules().items() if path.name == "__init__.py"
    }  # every package of the three folders, by the name it imports as
    assert set(cfg["packages"]) == folders


def test_imports_use_the_installed_names():
    """``protocols.x`` from a checkout would be a second copy of ``foltr_async.protocols.x``."""
    renamed = {f for f, name in package_names().items() if name != f}
    bad = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.relative_to(ROOT).parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in renamed]
    assert not bad, bad


def test_one_module_one_name():
    """Loading everything (protocols, plugins, benchmarks) from the checkout's root: every file
    is one module, nothing is importable as a top-level ``protocols`` or ``benchmarks`` (or, if
    something is, it is the same module object)."""
    code = (
        "import importlib, os, sys\n"
        "os.environ['FOLTR_ASYNC_PLUGINS'] = 'examples.fedavgm, examples.signflip'\n"
        "from foltr_async.plugins import load_plugins\n"
        "registry = load_plugins()\n"
        "import foltr_async.benchmarks.cli\n"
        "for top in ('protocols', 'benchmarks'):\n"
        "    try:\n"
        "        mod = importlib.import_module(top)\n"
        "    except ImportError as e:\n"
        "        print(top, 'refused:', e)\n"
        "    else:\n"
        "        print(top, 'same' if mod is sys.modules['foltr_async.' + top] else 'OTHER')\n"
        "files = {}\n"
        "for name, mod in list(sys.modules.items()):\n"
        "    f = getattr(mod, '__file__', None)\n"
        "    if f and os.path.realpath(f).startswith(os.getcwd()):\n"
        "        files.setdefault(os.path.realpath(f), []).append(name)\n"
        "print(sorted(n for n in files.values() if len(n) > 1))\n"
        "print(sorted(registry.protocols))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for line, top in zip(out[:2], ("protocols", "benchmarks"), strict=True):
        assert line.startswith(f"{top} refused: import foltr_async.{top}") or line == f"{top} same"
    assert out[2] == "[]"  # no file loaded under two names
    assert {"fedavgm", "fpdgd", "csfltr"} <= set(ast.literal_eval(out[3]))  # all loaded
