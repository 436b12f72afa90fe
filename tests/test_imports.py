"""The import graph of `wmrl_jax/` and `sandbox/`: no circles, no private names across modules, no JAX in sandbox/.

Module-level imports only (an import inside a function runs on use and is how
a heavy optional dependency -- Ray, torch, transformers -- stays out of
start-up); each is read from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("wmrl_jax", "sandbox")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: pathlib.Path, known: set[str], *, everywhere: bool = False
               ) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of each import statement of module `name`.

    `everywhere=False`: the imports that run when `name` is imported (module level,
    including under a module-level `if`/`try`); True: every import statement, those
    in function bodies too. `from pkg import mod` counts as importing `pkg.mod`.
    """
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, None, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = _absolute(node, name, path.name == "__init__.py")
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    out.append((sub, None, node.lineno) if sub in known else (mod, a.name, node.lineno))
            elif isinstance(node, (ast.If, ast.Try)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    if everywhere:
        visit([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))])
    else:
        visit(tree.body)
    return out


def import_graph(*, everywhere: bool = True) -> dict[str, set[str]]:
    """module -> the modules of the two packages it imports (`everywhere`: function-level imports too).

    A function-level import is still a dependency: a circle through one works only
    as long as nobody moves the import to the top, so the test counts them.
    """
    mods = modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        edges = set()
        for target, _, _ in imports_of(name, path, known, everywhere=everywhere):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def private_imports() -> list[tuple[str, int, str]]:
    """(file, line, "from X import _name") where X is another module of the two packages (lazy imports too)."""
    mods = modules()
    found = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                mod = _absolute(node, name, path.name == "__init__.py")
                if mod.split(".")[0] not in PACKAGES or mod == name:
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append((str(path.relative_to(ROOT)), node.lineno, f"from {mod} import {a.name}"))
    return found


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"module-level import cycles: {found}"


# Private names still imported across modules, each to be made public by its module's owner. The test
# fails when one goes away too (so the list only shrinks) and on any new one.
KNOWN_PRIVATE: set[str] = set()   # none left: a name another module needs is public


def test_no_private_names_across_modules():
    found = {f"{path}: {text}" for path, _, text in private_imports()}
    assert found == KNOWN_PRIVATE, (f"private names imported from another module: new {sorted(found - KNOWN_PRIVATE)},"
                                    f" gone from KNOWN_PRIVATE {sorted(KNOWN_PRIVATE - found)}")


def test_sandbox_imports_no_jax():
    mods = modules()
    found = []
    for name, path in mods.items():
        if not name.startswith("sandbox"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "wmrl_jax")]
    assert not found, "sandbox/ must not import JAX or wmrl_jax:\n" + "\n".join(found)


def test_pure_modules_import_no_model_sandbox_or_io():
    """losses, corrections and _isotonic: jax, chex, numpy and each other; no model, sandbox, file or network code."""
    allowed = {"__future__", "dataclasses", "functools", "math", "numbers", "typing", "enum", "jax", "chex", "numpy",
               "wmrl_jax.losses", "wmrl_jax.corrections", "wmrl_jax._isotonic", "wmrl_jax.checks"}
    mods = modules()
    found = []
    for name in ("wmrl_jax.losses", "wmrl_jax.corrections", "wmrl_jax._isotonic"):
        path = mods[name]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name}: {n}" for n in names if n not in allowed and n.split(".")[0] not in allowed]
    assert not found, "\n".join(found)


def test_the_checker_finds_a_cycle_and_a_private_import():
    """The graph code on a hand-made graph: a -> b -> c -> a is one cycle; d -> a is not part of it."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


if __name__ == "__main__":
    graph = import_graph()
    for name in sorted(graph):
        print(f"{name}: {', '.join(sorted(graph[name])) or '-'}")
    print("cycles:", cycles(graph))
    print("private:", *(f"{path}:{line}: {text}" for path, line, text in private_imports()), sep="\n  ")
