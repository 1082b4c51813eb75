"""The package's import graph: no circle among lattice's modules, counting every import (at module
level and inside functions: a lazy import that hides a circle is still one), and no family
module that knows about pipelines."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1] / "lattice"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the lattice modules it imports}, from every import statement in every file.
    `from P import a` counts as importing P.a when that is a module, else P."""
    modules = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = f

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: set() for m in modules}
    for m, f in modules.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    p = package.split(".")
                    base = ".".join(p[: len(p) - (node.level - 1)] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t)
                if r and r != m:
                    edges[m].add(r)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_finds_a_circle_when_there_is_one(tmp_path):
    """Catches a walker that cannot see circles (then the next test would pass on anything): two
    modules importing each other, one of them inside a function."""
    pkg = tmp_path / "lattice"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from lattice import b\n")
    (pkg / "b.py").write_text("def f():\n    from lattice.a import g\n")
    assert circles(import_graph(pkg)) == [["lattice.a", "lattice.b"]]


def test_lattice_has_no_import_circle():
    """Catches modules that import each other (cost <-> layout <-> model <-> pipeline, checkpoint <->
    sharded_checkpoint, as there were), whether the import is at the top or inside a function."""
    edges = import_graph()
    assert len(edges) > 30 and sum(map(len, edges.values())) > 100  # the walk saw the package
    assert circles(edges) == []


def test_family_modules_do_not_know_about_pipelines():
    """Catches a family that branches on pipeline stages instead of declaring its parts: in the
    family modules (every lattice/models/ file but the shared base, components, registry and moe.py,
    the MoE families' base, whose statistics cross the stages by the base's hooks) the word appears
    only in comments and docstrings."""
    for f in sorted((ROOT / "models").glob("*.py")):
        if f.name in ("base.py", "components.py", "registry.py", "hf.py", "moe.py", "__init__.py"):
            continue
        tree = ast.parse(f.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        code = [n for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute, ast.alias, ast.Constant))
                and id(n) not in docs]
        words = [getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None)
                 or (n.value if isinstance(n.value, str) else "") for n in code]
        assert not [w for w in words if w and "pipeline" in str(w).lower()], f.name


# The rooms, lowest first: a module may import from its own room and the rooms before it, never
# from one after it. The analytic model and its machines (cost) sit below the planner, which
# prices whole setups on them; calibration sits above both, since it fits what the planner's
# price of a pipeline leaves out. `lattice` is the public API (`import lattice`), which offers what the rooms
# below it build; `lattice.__main__` is `python -m lattice`.
LAYERS = ("lattice.parallel", "lattice.modes", "lattice.models", "lattice.checkpoint", "lattice.data",
          "lattice.cost", "lattice.planner", "lattice.calibration", "lattice.training", "lattice.bench", "lattice.cli", "lattice", "lattice.__main__")


def room(module: str) -> str:
    """The room of `module`: the longest entry of LAYERS that is it or contains it."""
    rooms = [r for r in LAYERS if module == r or module.startswith(r + ".")]
    assert rooms, f"{module} is in no room of LAYERS: add it to the order"
    return max(rooms, key=len)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    rank = {r: i for i, r in enumerate(LAYERS)}
    return sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets if rank[room(t)] > rank[room(m)])


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """Catches a layer check that passes on anything: the lowest room importing the highest, inside
    a function, is reported."""
    pkg = tmp_path / "lattice"
    for d in ("parallel", "cli"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "comm.py").write_text("def f():\n    from lattice.cli import main\n")
    (pkg / "cli" / "main.py").write_text("from lattice.parallel import comm\n")
    assert upward_imports(import_graph(pkg)) == ["lattice.parallel.comm -> lattice.cli.main"]


def test_imports_point_down_the_rooms():
    """Catches a module that imports from a room above its own (data reaching into checkpoints
    that sit above it, the cost model importing the command line, the trainer's config reading run
    directories through the CLI): every module is in a room of LAYERS, and every import goes to
    the same room or one below."""
    edges = import_graph()
    assert upward_imports(edges) == []


def private_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(module, name, line) of every underscore name `path` takes from a lattice module: imported
    by name, or read as an attribute of a lattice module it imported."""
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lattice"):
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append((node.module, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.name.startswith("lattice") and a.asname})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def test_the_private_check_sees_a_private_import(tmp_path):
    """Catches a private-import check that passes on anything: a name imported and an attribute
    read, both underscored, are each reported."""
    test = tmp_path / "test_x.py"
    test.write_text("from lattice.cost.model import _hidden\nimport lattice.cost.machine as m\nm._along(1)\n")
    found = private_imports(test, module_files())
    assert sorted(found) == [("lattice.cost.machine", "_along", 3), ("lattice.cost.model", "_hidden", 1)]


def test_no_private_name_crosses_a_room():
    """Catches a room that reaches into another's private helpers (calibration taking the
    cost model's underscored functions, a test pinning a private helper of the planner): no
    module takes an underscore name from a module of another room, and no test or benchmark
    takes one from lattice at all."""
    modules = module_files()
    crossing = [f"{f.relative_to(ROOT.parent)}:{line} {mod}.{name}" for m, f in modules.items()
                for mod, name, line in private_imports(f, modules) if room(mod) != room(m)]
    outside = [f"{f.relative_to(ROOT.parent)}:{line} {mod}.{name}"
               for folder in ("tests", "benchmarks") for f in sorted((ROOT.parent / folder).glob("*.py"))
               for mod, name, line in private_imports(f, modules)]
    assert crossing + outside == []


def test_no_module_holds_more_than_450_lines():
    """Catches a module grown past what one reads in a sitting, holding several concerns (as the
    model base, the trainer and the corpus once did): every module of the package is at most 450
    lines."""
    sizes = {str(f.relative_to(ROOT.parent)): len(f.read_text().splitlines()) for f in ROOT.rglob("*.py")}
    assert len(sizes) > 50
    assert {f: n for f, n in sizes.items() if n > 450} == {}
