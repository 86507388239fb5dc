"""The package's dependency rules, checked on the source:

* no import cycle among its modules (module-level and function-level imports, file granularity);
* imports point down the layers of :data:`LAYERS` (entry points on top; ``distributed`` imports
  nothing above it; the pipelines know nothing of the server);
* nothing below the entry-point layer imports ``argparse`` or touches an argparse ``Namespace``;
* every module imports on its own, first thing in a fresh interpreter;
* no module is longer than :data:`MAX_MODULE_LINES` unless it is one kernel or one cohesive
  algorithm, named in :data:`LONG_MODULES` with the reason.
"""

import ast
import os
import sys

import pytest

import serving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG_DIR = os.path.join(ROOT, "src", "ditattn")

# bottom to top; a module may import its own layer and the layers below it.  A new top-level
# module or package must be placed here (the test says so when one is not).
LAYERS = [
    ("errors", "settings", "extras", "lazy", "files"),
    ("attention", "platforms", "registry"),
    ("distributed",),
    ("cache",),  # step caching: read by the DiT's forward (models), imports attention and distributed
    ("models",),
    ("runconfig",),
    ("integrations",),
    ("pipelines",),
    ("evaluation",),  # compare runs pipelines; nothing below the entry points imports it
    ("server",),
    ("entrypoints", "cli", "__main__", "train"),  # train: python -m ditattn.train.shapes, imported by nothing
]
ENTRY_LAYER = LAYERS[-1]

# A module longer than this is split along its seams, unless it is one kernel or one cohesive
# algorithm: then it is named here with the reason (keep this short).  Counted in ruff format's layout
# (one argument per line once a call does not fit in 119 columns), about 1.3x the hand-packed lines.
MAX_MODULE_LINES = 600
LONG_MODULES = {
    "ditattn.attention.kernels.sage_sm90": "one kernel: the warp-specialised SM90 Gluon attention kernel "
    "(INT8 Q.K, FP16 / FP8 P.V) with its launch",
    "ditattn.attention.kernels.block_sparse_sm90": "one kernel: the warp-specialised SM90 Gluon block-sparse "
    "forward, its one-CTA-per-tile and persistent schedules sharing "
    "the jitted K/V loop, with its config and launch",
}


def _modules() -> dict:
    """``{"ditattn.x.y": path}`` for every module of the package."""
    out = {}
    base = os.path.dirname(PKG_DIR)
    for folder, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(open(path, encoding="utf-8").read(), path) for name, path in MODULES.items()}


def _imports(name: str) -> set:
    """The package modules ``name`` imports anywhere in its file (a package's own ``__init__``
    imported from inside it does not count)."""
    is_pkg = MODULES[name].endswith("__init__.py")
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), except those made only
    of a package and its own modules (its ``__init__`` re-exporting them)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in index:
            visit(v)
    return [c for c in out if not all(m == min(c, key=len) or m.startswith(min(c, key=len) + ".") for m in c)]


def _layer(name: str):
    """The layer index of a module (None for the package's own ``__init__``, the public facade)."""
    if name == "ditattn":
        return None
    top = name.split(".")[1]
    for i, members in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(
        f"ditattn.{top} is in no layer of tests/cli/test_architecture.py LAYERS; add it where its imports put it"
    )


def test_cycle_checker_finds_cycles():
    graph = {
        "ditattn.a": {"ditattn.b"},
        "ditattn.b": {"ditattn.c"},
        "ditattn.c": {"ditattn.a"},
        "ditattn.p": {"ditattn.p.x"},
        "ditattn.p.x": {"ditattn.p"},
        "ditattn.d": set(),
    }
    assert _cycles(graph) == [["ditattn.a", "ditattn.b", "ditattn.c"]]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_imports_point_down_the_layers():
    bad = []
    for name, targets in GRAPH.items():
        here = _layer(name)
        if here is None:
            continue
        for t in targets:
            there = _layer(t)
            if there is not None and there > here:
                bad.append(f"{name} -> {t}")
    assert bad == [], "imports that point up the layers: " + "; ".join(sorted(bad))
    # the rules the layers encode, spelled out
    assert not any(
        t.startswith(("ditattn.pipelines", "ditattn.server", "ditattn.entrypoints", "ditattn.models"))
        for n, ts in GRAPH.items()
        if n.startswith("ditattn.distributed")
        for t in ts
    )
    assert not any(
        t.startswith(("ditattn.server", "ditattn.entrypoints"))
        for n, ts in GRAPH.items()
        if n.startswith("ditattn.pipelines")
        for t in ts
    )


def test_nothing_below_the_entry_points_reads_argparse():
    bad = []
    for name, tree in TREES.items():
        if name != "ditattn" and name.split(".")[1] in ENTRY_LAYER:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
                bad.append(f"{name}: import argparse")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
                bad.append(f"{name}: from argparse import ...")
            elif isinstance(node, ast.Name) and node.id == "Namespace":
                bad.append(f"{name}: Namespace")
            elif isinstance(node, ast.Attribute) and node.attr == "Namespace":
                bad.append(f"{name}: .Namespace")
    assert bad == []


# first thing in a fresh interpreter: heavy third-party libraries are imported once, then every
# module is imported in its own forked child before any other ditattn module is loaded (the children
# are independent: one per core at a time)
_IMPORT_EACH = r"""
import importlib, os, sys, traceback
for lib in ("torch", "numpy", "diffusers", "transformers", "fastapi", "pydantic", "triton"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
assert not [m for m in sys.modules if m == "ditattn" or m.startswith("ditattn.")]
failed, running = [], {}


def reap():
    while True:
        pid, status = os.wait()
        if pid in running:
            break
    name = running.pop(pid)
    if status:
        failed.append(name)


for name in sys.argv[1:]:
    if len(running) >= max(2, os.cpu_count() or 1):
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(2, f"--- {name}\n{traceback.format_exc()}".encode())  # one write: children run side by side
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
print("FAILED:", " ".join(sorted(failed)))
sys.exit(1 if failed else 0)
"""


def _import_each_module(folder):
    names = sorted(n for n in MODULES if n != "ditattn.__main__")  # a script: importing it runs the CLI
    return dict(args=[sys.executable, "-c", _IMPORT_EACH, *names], env=serving.subprocess_env(), timeout=900)


@pytest.mark.background.with_args(_import_each_module)
def test_every_module_imports_first_in_a_fresh_interpreter(background_run):
    proc, _ = background_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert proc.stdout.strip() == "FAILED:"


def _too_long(lines: dict, allowed: dict, limit: int) -> tuple[list, list]:
    """``(modules over limit and not allowed, allowed modules that are gone or within the limit)``."""
    over = sorted(f"{name} ({n} lines)" for name, n in lines.items() if n > limit and name not in allowed)
    stale = sorted(name for name in allowed if lines.get(name, 0) <= limit)
    return over, stale


def test_size_check_finds_long_modules():
    lines = {"ditattn.a": 451, "ditattn.b": 450, "ditattn.k": 900, "ditattn.c": 10}
    assert _too_long(lines, {"ditattn.k": "kernel"}, 450) == (["ditattn.a (451 lines)"], [])
    assert _too_long(lines, {"ditattn.k": "kernel", "ditattn.c": "x", "ditattn.gone": "y"}, 450) == (
        ["ditattn.a (451 lines)"],
        ["ditattn.c", "ditattn.gone"],
    )


def test_modules_stay_short():
    lines = {}
    for name, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            lines[name] = sum(1 for _ in fh)
    over, stale = _too_long(lines, LONG_MODULES, MAX_MODULE_LINES)
    assert over == [], (
        f"modules over {MAX_MODULE_LINES} lines: {', '.join(over)}; split them along their seams "
        "(or, for one kernel / one cohesive algorithm, add them to LONG_MODULES with the reason)"
    )
    assert stale == [], f"LONG_MODULES entries that are gone or short again (remove them): {', '.join(stale)}"
    assert all(reason.strip() for reason in LONG_MODULES.values())
