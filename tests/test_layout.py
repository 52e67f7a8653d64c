"""The shape of the package, checked from its source (docs/architecture.md states the rules): every module sits on a
floor and imports only its own floor or lower ones; no import cycle; no function-level kvpress import (they hide
cycles), except of a module that needs an optional dependency (triton, vllm) which a plain import would require;
no file over 400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpress"
MAX_LINES = 400
OPTIONAL = ("triton", "vllm")  # third-party packages kvpress runs without

# (path prefix, floor): the longest matching prefix decides
FLOORS = [
    ("kvpress/formats/", 1), ("kvpress/positions.py", 1), ("kvpress/heads.py", 1), ("kvpress/needle.py", 1),
    ("kvpress/questions.py", 1), ("kvpress/version.py", 1), ("kvpress/progress.py", 1),
    ("kvpress/kernels/", 2), ("kvpress/models.py", 2),
    ("kvpress/cache/", 3),
    ("kvpress/policies/", 4),
    ("kvpress/integrations/", 5), ("kvpress/arguments.py", 5),
    ("kvpress/", 6),  # calibration fitting and its CLI, speculative/, compressed.py, the demo, the package's face
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    path = module.replace(".", "/")
    candidates = [path + ".py", path + "/"]
    return max(((len(prefix), floor) for prefix, floor in FLOORS
                if any(c.startswith(prefix) for c in candidates)))[1]  # the longest prefix decides


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Absolute kvpress module names an import statement loads (a name imported from a package may be a module)."""
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("kvpress"):
        return []
    # `from package import module` loads the module (the package's face is already importing, or imported);
    # `from module import name` loads the module
    modules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return modules or [target]


class Module:
    def __init__(self, path: Path):
        self.path = path
        self.name = _module_name(path)
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text())
        self.lines = len(path.read_text().splitlines())

    def imports(self, top_level: bool):
        """(kvpress module names, line) of import statements at module level (top_level) or inside functions."""
        inside = set()
        for fn in ast.walk(self.tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(self.tree):
            if (id(node) in inside) == top_level:
                continue
            if isinstance(node, ast.ImportFrom):
                yield _resolve(self.name, self.is_package, node), node.lineno
            elif isinstance(node, ast.Import):
                yield [a.name for a in node.names if a.name.startswith("kvpress")], node.lineno

    def third_party(self) -> set[str]:
        out = set()
        # module level only (also inside `try:`, an optional import): what importing this module loads
        body = [n for top in self.tree.body for n in (top.body if isinstance(top, ast.Try) else [top])]
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                out.add(node.module.split(".")[0])
        return out


MODULES = {m.name: m for m in map(Module, sorted(PACKAGE.rglob("*.py")))}


def _existing(names: list[str]) -> list[str]:
    return [n for n in names if n in MODULES]


def _graph() -> dict[str, set[str]]:
    return {name: {t for names, _ in m.imports(top_level=True) for t in _existing(names) if t != name}
            for name, m in MODULES.items()}


def _loads_optional(name: str, seen=None) -> bool:
    """Importing module `name` loads an optional dependency (itself, or through the kvpress modules it imports)."""
    seen = set() if seen is None else seen
    seen.add(name)
    if MODULES[name].third_party() & set(OPTIONAL):
        return True
    return any(_loads_optional(t, seen) for t in _graph()[name] if t not in seen)


def test_no_file_over_the_limit():
    long = {str(m.path.relative_to(ROOT)): m.lines for m in MODULES.values() if m.lines > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_imports_never_go_up_a_floor():
    upward = [f"{name} (floor {_floor(name)}) imports {t} (floor {_floor(t)})" for name, targets in _graph().items()
              for t in targets if _floor(t) > _floor(name) and not t == "kvpress"]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("low", ["kvpress.formats", "kvpress.kernels"])
def test_formats_and_kernels_import_no_upper_layer(low):
    for name, targets in _graph().items():
        if name == low or name.startswith(low + "."):
            bad = [t for t in targets if t.split(".")[1] in ("cache", "policies", "integrations", "speculative")]
            assert not bad, f"{name} imports {bad}"


def test_no_import_cycle():
    graph = _graph()
    # a package's face (__init__) re-exports its modules: an edge into a package is an edge to the face only
    state, stack_path = {}, []

    def visit(node):
        state[node] = "open"
        stack_path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack_path[stack_path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack_path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_function_level_kvpress_imports_only_for_optional_dependencies():
    hidden = []
    for name, m in MODULES.items():
        for names, line in m.imports(top_level=False):
            targets = _existing(names)
            needs_optional = any(_loads_optional(t) for t in targets)
            if targets and not needs_optional:
                hidden.append(f"{m.path.relative_to(ROOT)}:{line} imports {targets} inside a function")
    assert not hidden, "\n".join(hidden)


def _outside_policies():
    """The package's modules outside kvpress/policies/, and evals/ (what must ask a policy, not know it)."""
    evals = [Module(p) for p in sorted((ROOT / "evals").rglob("*.py"))]
    return [m for m in MODULES.values() if not m.name.startswith("kvpress.policies")] + evals


def _registered():
    from kvpress.policies import get_policy_class, list_policies
    return {name: get_policy_class(name).__name__ for name in list_policies()}


def test_no_isinstance_test_on_a_concrete_policy_outside_policies():
    """A policy answers for itself (roles, Policy's properties); code that uses policies asks them, it does not test
    for a particular class (roles, which are types on purpose, may be tested: roles.py)."""
    concrete = set(_registered().values())
    found = []
    for m in _outside_policies():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None) for n in ast.walk(node.args[1])}
                if names & concrete:
                    found.append(f"{m.path.relative_to(ROOT)}:{node.lineno} {sorted(names & concrete)}")
    assert not found, found


def test_no_table_of_policy_names_outside_the_registry():
    """A dict, list, tuple or set literal naming two or more registered policies outside policies/ is a second
    registry, which a new policy would have to be taught (the registry, a role or a property answers instead)."""
    names = set(_registered())
    found = []
    for m in _outside_policies():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
                if len(named) >= 2:
                    found.append(f"{m.path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    assert not found, found
