"""The package's layout: its modules import one another at the top and without cycles, so a module that
several others need is a leaf, and none imports inside a function to get around a cycle."""

import ast
import pkgutil
from pathlib import Path

import dflash_mlx
import dflash_mlx.cli
import dflash_mlx.models


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package (the models/ and cli/ folders map into it)."""
    found = {"dflash_mlx": Path(dflash_mlx.__file__)}
    for package in (dflash_mlx, dflash_mlx.models, dflash_mlx.cli):
        found[package.__name__] = Path(package.__file__)
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not info.ispkg:
                found[info.name] = Path(info.module_finder.path) / f"{info.name.rsplit('.', 1)[1]}.py"
    return found


def imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """The package's modules that `name` imports: (at import time, inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top, inner = set(), set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - child.level + 1] + [base]
                    ).strip(".")
                targets = [base] + [f"{base}.{a.name}" for a in child.names]
            (inner if in_function else top).update(t for t in targets if t in known and t != name)
            visit(
                child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            )

    visit(ast.parse(path.read_text()), False)
    return top, inner


def test_modules_import_one_another_at_the_top_and_without_cycles():
    found = modules()
    assert {"dflash_mlx.pairing", "dflash_mlx.models.targets", "dflash_mlx.cli.options"} <= set(found)
    graph, inside = {}, {}
    for name, path in found.items():
        graph[name], inside[name] = imports(name, path, set(found))
    # A lazy import of our own is a cycle hidden; the one exception is the entry point, which imports
    # the app inside its Ctrl-C guard (cli/__init__.py).
    assert {k: v for k, v in inside.items() if v} == {"dflash_mlx.cli": {"dflash_mlx.cli.main"}}
    assert "dflash_mlx.pairing" in graph["dflash_mlx.cache"]  # (the walk does see imports)
    state, path = {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for other in sorted(graph[name]):
            assert state.get(other) != "open", "import cycle: " + " -> ".join(
                path[path.index(other) :] + [other]
            )
            if other not in state:
                visit(other)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
