"""The import graph of the `sparsekv` package: no cycles, no upward imports, tools out of the runtime's way.

The graph is read with `ast`, nothing is imported: every `import` and `from ... import` in every module,
at module level and inside functions (a function-level import is still a dependency, only a later one),
relative imports resolved, plus `importlib.import_module("literal")` / `__import__("literal")`. Imports by a
computed name (the `sparsekv` dispatch table in `__main__.py`, `bench.py`'s sub-benchmarks) are plugin
registries, not edges.

`from X import name` is an edge to the submodule X.name when there is one, else to X. `import a.b.c` is an
edge to a.b.c only, not to the packages above it, though Python runs their `__init__` first: that is sound
because every package `__init__` imports only the bottom layer at module level (test_package_inits_are_light)
— `sparsekv/__init__.py` exposes `LLM` and `LLMEngine` lazily (a module `__getattr__`), so `import
sparsekv.config` never loads the engine. The lazy imports are still edges of `__init__` itself, which is
why it sits in the engine layer: code that does `from sparsekv import LLM` depends on the engine.

To place a new module: add it (or its package) to LAYERS. An exception that has to stay for now goes in
ALLOWED_TODAY / ALLOWED_CYCLES with its reason; an entry that no longer happens fails the test until
it is removed.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "sparsekv"
PKG = "sparsekv"

# Bottom to top. A module may import its own layer and the layers below it, never one above. Names are
# relative to `sparsekv`; a name covers the module or package and everything under it ("cache" is
# cache/__init__.py and cache/*); the longest matching name wins; "__init__" is sparsekv/__init__.py.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # no sparsekv imports but each other's; engine_args/units: the engine options' argparse (torch-free)
    ("basics", ("config", "request", "context", "paths", "units", "engine_args", "detokenize", "sampling",
                "kernels", "hub", "sampling_params", "outputs", "scheduler_output", "daemon", "error_text")),
    ("collectives", ("parallel.comm", "parallel.layout", "weight_sync")),  # who holds which slice; torch.distributed calls
    ("model", ("model",)),                   # the network: reads the cache only through context.py
    ("cache", ("cache",)),                   # page allocator, prefix cache and its tiers, pools, tiering
    ("scheduling", ("scheduler", "runner", "speculative", "structured")),
    ("engine", ("engine", "engine_weights", "llm", "executor", "parallel", "input_processor", "output_processor", "__init__",
                "weights", "routing", "threads")),
    ("server", ("server", "disagg")),        # disagg: the prefill/decode roles of a server, and the router
    ("train", ("train",)),                   # the bundled model's training: uses model/, not the engine
    ("tools", ("tools",)),                   # benchmarks, planner, evals; they also use train/ (data, stages)
    ("rollout", ("rollout",)),               # RL episodes against an OpenAI endpoint; no engine import
    ("entry points", ("cli", "__main__")),
]

# Only these may import sparsekv.tools, at module level or inside a function: the engine, the server and
# training must run without the tools' code (and their dependencies) in the way.
TOOLS = "tools"
MAY_IMPORT_TOOLS = ("tools", "cli", "__main__")

# (importer, imported) -> why it is still there. Upward imports inside files being refactored elsewhere.
ALLOWED_TODAY: dict[tuple[str, str], str] = {}

# frozenset of the modules of an import cycle -> why it is still there.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str      # module names relative to sparsekv ("server.app", "__init__")
    imported: str
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}{' (in a function)' if self.in_function else ''}"


def rel(name: str) -> str:
    return "__init__" if name == PKG else name.removeprefix(PKG + ".")


def module_path(module: str) -> str:
    return str(MODULES[module][0].relative_to(ROOT.parent))


def find_modules() -> dict[str, tuple[Path, bool]]:
    """Relative module name -> (file, is a package __init__)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[rel(".".join(parts))] = (path, is_package)
    return modules


MODULES = find_modules()


def known(full_name: str) -> str | None:
    """The longest sparsekv module that `full_name` starts with (a.b.Class -> a.b), or None outside sparsekv."""
    parts = full_name.split(".")
    if parts[0] != PKG:
        return None
    while parts:
        name = rel(".".join(parts))
        if name in MODULES:
            return name
        parts.pop()
    return None


def absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a relative import `from .{level}target import ...` in `module`."""
    full = PKG if module == "__init__" else f"{PKG}.{module}"
    base = full.split(".") if is_package else full.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _in_functions(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a def or lambda."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if n is not fn)
    return inside


def _dynamic_target(node: ast.Call, module: str, is_package: bool) -> str | None:
    """`importlib.import_module("x"[, package])` or `__import__("x")` with a literal name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    text = arg.value
    if text.startswith("."):
        level = len(text) - len(text.lstrip("."))
        return absolute(module, is_package, level, text[level:] or None)
    return text


def edges_of(module: str) -> list[Edge]:
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    inside = _in_functions(tree)
    edges = []

    def add(full_name: str, node: ast.AST) -> None:
        target = known(full_name)
        if target is not None and target != module:
            edges.append(Edge(module, target, node.lineno, id(node) in inside))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, is_package, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if known(sub) == rel(sub) else base, node)
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node, module, is_package)
            if target is not None:
                add(target, node)
    return list(dict.fromkeys(edges))   # `from x import a, b`: one edge


GRAPH: dict[str, list[Edge]] = {m: edges_of(m) for m in MODULES}


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    if best is None:
        raise KeyError(module)
    return best


def _matches(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def upward_imports() -> list[Edge]:
    return [e for edges in GRAPH.values() for e in edges if layer_of(e.imported) > layer_of(e.importer)]


def tools_imports() -> list[Edge]:
    return [e for edges in GRAPH.values() for e in edges
            if _matches(e.imported, (TOOLS,)) and not _matches(e.importer, MAY_IMPORT_TOOLS)]


def tools_strings() -> list[tuple[str, int, str]]:
    """'sparsekv.tools...' in a string (a `python -m`, a computed import) outside the modules that may use
    the tools; docstrings aside."""
    found = []
    for module, (path, _) in MODULES.items():
        if _matches(module, MAY_IMPORT_TOOLS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and re.search(rf"\b{PKG}\.{TOOLS}\b", node.value)):
                found.append((module, node.lineno, node.value))
    return found


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    succ = {m: sorted({e.imported for e in edges}) for m, edges in GRAPH.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def layer_name(module: str) -> str:
    return LAYERS[layer_of(module)][0]


# --- the tests ----------------------------------------------------------------------------------------


def test_the_graph_is_read():
    """Guards the reader itself: edges it must see, of each kind."""
    def has(a, b, in_function=None):
        return any(e.imported == b and (in_function is None or e.in_function == in_function) for e in GRAPH[a])
    assert has("engine", "scheduler", in_function=False)                 # from .scheduler import ...
    assert has("__init__", "engine", in_function=True)                   # the lazy LLMEngine
    assert has("__init__", "config", in_function=False)
    assert has("runner", "scheduler") and has("cache.prefix", "cache.pages")   # relative, inside a package
    assert has("model.attention", "kernels.attention")                   # from ..kernels.attention
    assert has("server.app", "request")                                  # from ..request
    assert has("cli", "tools.tiny", in_function=True)                    # make-tiny-model, inside a function
    assert has("tools.plan", "tools.plan_sweep", in_function=True)       # from sparsekv.tools import plan_sweep


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            missing.append(module_path(module))
    assert not missing, f"add these to LAYERS in tests/test_imports.py: {missing}"
    names = [n for _, names in LAYERS for n in names]
    assert len(names) == len(set(names)), "a name is in LAYERS twice"


def test_package_inits_are_light():
    """Why edges skip the packages above a module: every package __init__ imports only the bottom layer at
    module level (sparsekv/__init__.py: config and request; the engine lazily), so importing any module
    runs nothing but that besides the module's own imports."""
    heavy = [f"{e.where()} imports {e.imported}" for m, (_, is_package) in MODULES.items() if is_package
             for e in GRAPH[m] if not e.in_function and layer_of(e.imported) > 0]
    assert not heavy, heavy


def test_no_import_cycles():
    found = {frozenset(c): c for c in cycles()}
    new = [c for key, c in found.items() if key not in ALLOWED_CYCLES]
    stale = [sorted(key) for key in ALLOWED_CYCLES if key not in found]
    details = []
    for c in new:
        members = set(c)
        details.append(" <-> ".join(c) + ": " + "; ".join(
            f"{e.where()} imports {e.imported}" for m in c for e in GRAPH[m] if e.imported in members))
    assert not new, "import cycles:\n" + "\n".join(details)
    assert not stale, f"no longer cycles, remove from ALLOWED_CYCLES: {stale}"


def test_no_upward_imports():
    found = upward_imports()
    new = [e for e in found if (e.importer, e.imported) not in ALLOWED_TODAY]
    stale = sorted(set(ALLOWED_TODAY) - {(e.importer, e.imported) for e in found})
    assert not new, "upward imports (a lower layer importing a higher one; see LAYERS):\n" + "\n".join(
        f"{e.where()}: {e.importer} ({layer_name(e.importer)}) imports {e.imported} ({layer_name(e.imported)})"
        for e in new)
    assert not stale, f"no longer upward, remove from ALLOWED_TODAY: {stale}"


def test_tools_out_of_the_runtime():
    bad = [f"{e.where()}: {e.importer} imports {e.imported}" for e in tools_imports()]
    bad += [f"{module_path(m)}:{line}: {m} names {text!r}" for m, line, text in tools_strings()]
    assert not bad, (f"only {', '.join(MAY_IMPORT_TOOLS)} may use sparsekv.{TOOLS} (move the shared helper "
                     "below both):\n" + "\n".join(bad))


@pytest.mark.parametrize("source, expected", [
    ("from ..cli import parse_bytes\n", [("cli", False)]),
    ("def f():\n    from sparsekv.tools import hardware\n", [("tools.hardware", True)]),
    ("import importlib\nm = importlib.import_module('sparsekv.tools.bench')\n", [("tools.bench", False)]),
    ("from .. import LLM\n", [("__init__", False)]),
    ("import sparsekv.engine as e\n", [("engine", False)]),
])
def test_reader_on_snippets(tmp_path, monkeypatch, source, expected):
    """The reader on small sources placed as sparsekv/server/_probe.py (not written into the package)."""
    probe = tmp_path / "_probe.py"
    probe.write_text(source)
    monkeypatch.setitem(MODULES, "server._probe", (probe, False))
    got = [(e.imported, e.in_function) for e in edges_of("server._probe")]
    assert got == expected


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT.parent / "scripts").glob("*.py")))
def test_what_a_script_imports_from_sparsekv_exists(script):
    """scripts/ is not imported by any test run, so a name moved between modules would break a script
    only when someone runs it: each `from sparsekv... import name`, at any level, must resolve."""
    import importlib.util
    tree = ast.parse((ROOT.parent / "scripts" / script).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PKG:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"scripts/{script}:{node.lineno}: {node.module} has no {alias.name}"
