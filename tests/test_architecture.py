"""The package's import graph obeys the data path: no import circles, no edge from a lower layer up.

Every module of ``megatron_xmod`` is read as source (module-level imports and imports inside
functions alike, since a deferred import is still a dependency) and placed on one layer of
:data:`LAYERS`, lowest first. A module may import modules of its own layer or below; an import of a
higher layer, or any circle, fails the test with the edge or the circle named.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_xmod"

# Lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megatron boundary (CPU shim)", ("megatron_xmod.cpu_shim",)),
    ("layout", ("megatron_xmod.xmod.layout",)),
    ("catalog (names, backbones, counts)", ("megatron_xmod.presets", "megatron_xmod.moe.presets",
                                            "megatron_xmod.accounting")),
    ("routing", ("megatron_xmod.xmod.routing", "megatron_xmod.moe.scores")),
    ("routing state, kernels, permute", ("megatron_xmod.xmod.routing_state", "megatron_xmod.xmod.kernels",
                                         "megatron_xmod.xmod.permute")),
    ("config", ("megatron_xmod.xmod.config", "megatron_xmod.moe.config")),
    ("layers", ("megatron_xmod.xmod.layers", "megatron_xmod.moe.router", "megatron_xmod.moe.losses")),
    ("block", ("megatron_xmod.xmod.block", "megatron_xmod.block", "megatron_xmod.xmod.compile")),
    ("model", ("megatron_xmod.model", "megatron_xmod.moe.model", "megatron_xmod.spec")),
    ("pipeline", ("megatron_xmod.pipeline",)),
    ("data", ("megatron_xmod.data",)),
    ("training", ("megatron_xmod.training", "megatron_xmod.moe.args", "megatron_xmod.pretrain")),
    ("export", ("megatron_xmod.hf",)),
    ("diagnostics, scaling, demo", ("megatron_xmod.diagnostics", "megatron_xmod.scaling", "megatron_xmod.demo")),
    ("command line", ("megatron_xmod.cli",)),
)
# Package roots that hold nothing but a docstring.
NAMESPACES = ("megatron_xmod", "megatron_xmod.xmod", "megatron_xmod.moe")


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project modules it imports}; ``from pkg import name`` counts as an import of
    ``pkg.name`` when that is a module, else of ``pkg``."""

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.add(full)
                    elif base in modules or not node.level:
                        targets.add(owner(base))
                    # else: a relative import of a file that exists only in an exported HF folder (its
                    # verbatim copies of routing.py and moe/scores.py), never inside the package
        graph[name] = {t for t in targets if t and t != name and t.startswith("megatron_xmod")}
    return graph


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    if best is None:
        raise AssertionError(f"{module}: on no layer of tests/test_architecture.py LAYERS; add it where the data "
                             "path puts it")
    return best


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a in sorted(graph) if a not in NAMESPACES for b in sorted(graph[a])
            if b not in NAMESPACES and layer_of(b) > layer_of(a)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a cycle path."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_on_a_layer():
    for module in module_files():
        if module not in NAMESPACES:
            layer_of(module)


def test_no_import_circles():
    found = circles(import_graph(module_files()))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_upward_imports():
    edges = upward_edges(import_graph(module_files()))
    assert not edges, "imports against the data path:\n  " + "\n  ".join(edges)


def test_namespace_packages_hold_no_imports():
    graph = import_graph(module_files())
    for name in NAMESPACES:
        assert not graph[name], f"{name}/__init__.py imports {sorted(graph[name])}; keep package roots empty"


def test_the_checker_finds_a_planted_circle_and_an_upward_edge(tmp_path):
    package = tmp_path / "megatron_xmod"
    (package / "xmod").mkdir(parents=True)
    (package / "training").mkdir()
    for init in (package, package / "xmod", package / "training"):
        (init / "__init__.py").write_text("")
    (package / "xmod" / "routing.py").write_text("def f():\n    from megatron_xmod.training import step\n")
    (package / "training" / "step.py").write_text("from megatron_xmod.xmod.routing import f\n")
    graph = import_graph(module_files(package))
    assert graph["megatron_xmod.xmod.routing"] == {"megatron_xmod.training.step"}  # a deferred import counts
    assert circles(graph) == [["megatron_xmod.training.step", "megatron_xmod.xmod.routing"]]
    assert upward_edges(graph) == ["megatron_xmod.xmod.routing (routing) imports megatron_xmod.training.step (training)"]
    with pytest.raises(AssertionError, match="megatron_xmod.elsewhere: on no layer"):
        layer_of("megatron_xmod.elsewhere")


# The only modules that may assign to megatron's attributes (the CPU shim, the numbered patches).
MEGATRON_BOUNDARY = ("megatron_xmod.cpu_shim", "megatron_xmod.training.patches")


def megatron_assignments(path: Path) -> list[str]:
    """``name.attr = ...`` / ``setattr(name, ...)`` where ``name`` was imported from megatron in that file."""
    tree = ast.parse(path.read_text(), str(path))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("megatron."))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.") and not node.level:
            imported.update(a.asname or a.name for a in node.names)

    def root(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and root(target) in imported:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(target)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and root(node.args[0]) in imported:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_megatron_is_changed_only_at_the_boundary():
    found = [hit for name, path in module_files().items() if name not in MEGATRON_BOUNDARY
             for hit in megatron_assignments(path)]
    assert not found, ("changes to megatron outside cpu_shim.py and training/patches.py (number them there):\n  "
                       + "\n  ".join(found))
    assert megatron_assignments(PACKAGE / "training" / "patches.py") == []  # it changes megatron through install()
    planted = PACKAGE.parent / "tests" / "_planted_patch.py"
    try:
        planted.write_text("import megatron.training.training as training\n\ntraining.evaluate = None\n")
        assert megatron_assignments(planted) == ["_planted_patch.py:3 training.evaluate = ..."]
    finally:
        planted.unlink()


def test_numbered_patches_install_once_and_are_listed():
    import types

    from megatron_xmod.training.patches import install, installed

    owner = types.SimpleNamespace(__name__="fake_megatron_module", step=lambda x: x + 1)
    wrapped = []

    def make_wrapper(original):
        wrapped.append(original)
        return lambda x: original(x) * 10

    first = install(99, owner, "step", make_wrapper)
    again = install(99, owner, "step", make_wrapper)
    assert first is again and len(wrapped) == 1 and owner.step(1) == 20  # wrapped once, not twice
    assert installed()[99] == "fake_megatron_module.step"


def test_the_argument_dump_patch_is_undone():
    import argparse
    import io

    import megatron.training.arguments as arguments

    from megatron_xmod.training.patches import capture_argument_dump, installed

    original = arguments._print_args
    buffer = io.StringIO()
    restore = capture_argument_dump(buffer)
    try:
        assert arguments._print_args is not original and 22 in installed()
        arguments._print_args("arguments", argparse.Namespace(seed=7))
    finally:
        restore()
    assert arguments._print_args is original and 22 not in installed()
    assert "seed" in buffer.getvalue()
