"""The structure the code promises, checked on the code itself (its imports, as written):

* layers: the core (``sensai/`` but the CLI and the benchmark) imports no stage; training,
  pruning and serving import only the core (serving never training or pruning); the benchmark
  (``sensai/bench``) imports the core and serving, and nothing but the CLI imports it; only the
  CLI imports everything, and nothing imports the CLI;
* serving's wings, along the request path: ``core`` (settings, errors, messages, placement)
  imports no other wing; ``workers`` only the core; ``transports`` the workers; ``engine`` (the
  predictor, its pool and supervisor) the transports; ``gateway`` (HTTP, gRPC, admission) only
  the core, so it serves any predictor; ``launch`` (plans, backends, Ray Serve, Triton) all;
* no two modules import each other, even through a function-level import;
* no ``_private`` name is imported from another module;
* imports sit at the top of a module - a project module may be imported inside a function only
  when it pulls in a heavy optional dependency (torch, which an ONNX-only gateway or worker
  must not load; Ray; tritonclient; matplotlib; ONNX Runtime) - and the CLI may import lazily so
  ``sensai --help`` stays fast;
* the command line's modules, the gateway and its local workers import nothing heavy at their
  top level (tests/test_imports.py checks the running processes);
* every package folder is installed (listed in pyproject.toml).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"sensai": "sensai", "serving": "sensai.serving", "pruning": "sensai.pruning",
           "training": "sensai.training"}
HEAVY = ("torch", "torchvision", "ray", "tritonclient", "matplotlib", "onnxruntime")


def modules() -> dict[str, Path]:
    """Dotted installed name -> file, for every module of the project."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


WINGS = {"core": {"core"}, "workers": {"core", "workers"},
         "transports": {"core", "workers", "transports"},
         "engine": {"core", "workers", "transports", "engine"}, "gateway": {"core", "gateway"},
         "launch": {"core", "workers", "transports", "engine", "gateway", "launch"}}


def wing(name: str) -> str | None:
    """The serving wing of module ``name`` (None outside serving)."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["sensai", "serving"] and len(parts) > 3 else None


def layer(name: str) -> str:
    if name.startswith("sensai.cli") or name == "sensai.__main__":
        return "cli"
    if name.startswith("sensai.bench"):
        return "bench"
    for stage in ("serving", "pruning", "training"):
        if name.startswith(f"sensai.{stage}"):
            return stage
    return "core"


def imports(name: str):
    """(imported module, names, line, inside a function?) for every import in module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(x) for f in funcs for x in ast.walk(f) if x is not f}
    # `if TYPE_CHECKING:` imports are for annotations only: never executed.
    typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(n.test) for x in ast.walk(n)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno, id(node) in inner
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            # `from package import module` imports that module.
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            for n in submodules:
                yield f"{target}.{n}", [], node.lineno, id(node) in inner
            if len(submodules) < len(names):
                yield target, [n for n in names if n not in submodules], node.lineno, \
                    id(node) in inner


def project(target: str) -> str | None:
    """The project module an import refers to (a module, or the package of an imported name)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def top_level_heavy() -> set[str]:
    """Project modules that import a heavy dependency at their top level, directly or through
    another project module."""
    direct = {}
    for name in MODULES:
        deps = set()
        for target, _, _, inner in imports(name):
            if inner:
                continue
            if target.split(".")[0] in HEAVY:
                deps.add("HEAVY")
            elif (p := project(target)) and p != name:
                deps.add(p)
        direct[name] = deps
    heavy, changed = set(), True
    while changed:
        changed = False
        for name, deps in direct.items():
            if name not in heavy and ("HEAVY" in deps or deps & heavy):
                heavy.add(name)
                changed = True
    return heavy


ALLOWED = {"core": {"core"}, "training": {"core", "training"}, "pruning": {"core", "pruning"},
           "serving": {"core", "serving"}, "bench": {"core", "serving", "bench"},
           "cli": {"core", "training", "pruning", "serving", "bench", "cli"}}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers(name):
    own = layer(name)
    for target, _, line, _ in imports(name):
        p = project(target)
        if p is None:
            continue
        assert layer(p) in ALLOWED[own], \
            f"{MODULES[name].relative_to(ROOT)}:{line}: the {own} layer imports {p} ({layer(p)})"


def test_every_serving_module_is_in_a_wing():
    loose = [n for n in MODULES if n.startswith("sensai.serving.") and wing(n) is None
             and MODULES[n].name != "__init__.py"]
    assert not loose and {wing(n) for n in MODULES} - {None} == set(WINGS), loose


@pytest.mark.parametrize("name", sorted(n for n in MODULES if wing(n)))
def test_the_wings_point_one_way(name):
    own = wing(name)
    for target, _, line, _ in imports(name):
        p = project(target)
        if p is not None and wing(p) is not None:
            assert wing(p) in WINGS[own], \
                f"{MODULES[name].relative_to(ROOT)}:{line}: the {own} wing imports {p}"


def test_no_module_imports_itself_back():
    """Strongly connected modules (function-level imports count: a cycle that works only
    because one import waits inside a function is still two modules that need each other)."""
    graph = {name: {p for target, _, _, _ in imports(name)
                    if (p := project(target)) and p != name and MODULES[p].name != "__init__.py"}
             for name in MODULES if MODULES[name].name != "__init__.py"}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_only_the_entry_point_imports_the_cli():
    for name in MODULES:
        if layer(name) == "cli":
            continue
        for target, _, line, _ in imports(name):
            assert layer(project(target) or "x") != "cli", f"{name}:{line} imports the CLI"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_across_modules(name):
    for target, names, line, _ in imports(name):
        if project(target) and project(target) != name:
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{MODULES[name].relative_to(ROOT)}:{line}: imports {private} " \
                                f"from {target}"


def test_imports_are_at_the_top():
    heavy = top_level_heavy()
    assert "sensai.checkpoint" in heavy and "sensai.artifact" not in heavy
    bad = []
    for name in MODULES:
        if layer(name) == "cli":
            continue  # the CLI imports what a command needs when it runs
        for target, _, line, inner in imports(name):
            p = project(target)
            if inner and p is not None and p not in heavy:
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line}: {target}")
    assert not bad, "project imports inside functions (of light modules):\n" + "\n".join(bad)


def test_onnx_only_paths_load_nothing_heavy():
    heavy = top_level_heavy()
    light = ("sensai.artifact", "sensai.manifest", "sensai.models", "sensai.spec",
             "sensai.serving.workers.runners", "sensai.serving.workers.loop",
             "sensai.serving.transports.devices", "sensai.serving.transports.threads",
             "sensai.serving.engine.predictor", "sensai.serving.engine.pool",
             "sensai.serving.engine.plan", "sensai.serving.gateway.app",
             "sensai.serving.gateway.imaging", "sensai.serving.launch.build",
             *(name for name in MODULES if layer(name) == "cli"))
    assert sorted(name for name in light if name in heavy) == []


def test_every_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert found == listed, f"not installed: {sorted(found - listed)}; " \
                            f"listed but absent: {sorted(listed - found)}"
    for folder, package in FOLDERS.items():
        if package != "sensai":
            assert config["package-dir"][package] == folder
