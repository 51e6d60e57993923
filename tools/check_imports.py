"""Check amp_patch's import graph: imports only go down the layers, and nothing forms a circle.

The layers, lowest first, are declared once in :data:`LAYERS` (docs/design.md
explains them). A module may import modules of its own layer and of the layers
below it. Two checks run over every ``.py`` file of the package:

- **no upward import**: an import that runs (at module level or inside a
  function) must not name a module of a higher layer. Imports under
  ``if TYPE_CHECKING:`` are exempt from this rule only;
- **no cycle**: the graph of all imports, ``TYPE_CHECKING`` ones and those
  inside functions included, has no circle;
- **a folder is a layer**: every module in a folder (a subpackage) belongs to the
  folder's layer. A layer of one module (the scaler, the session) is that module at
  the top of the package; so are the build's private modules and the public names.

An import names the module it spells: ``import amp_patch.a.b`` and
``from amp_patch.a import b`` (b a submodule) name ``amp_patch.a.b``; the
parent packages that Python also runs are not counted, as each package's
``__init__`` is checked on its own. Every module must belong to a layer, so a
new module needs a row in the table.

Run ``python tools/check_imports.py`` from the repository root; it prints the
problems and exits 1 if there are any. ``tests/test_import_graph.py`` runs it in
``make test``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "amp_patch"

#: The layers, lowest first: (name, module patterns). A pattern is a module name,
#: or a name ending in ".*" for a package and everything below it. The longest
#: matching pattern wins; a module still sits in its folder's layer (checked).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("build", ("amp_patch._C", "amp_patch._native", "amp_patch._buildspec")),
    ("helpers", ("amp_patch.helpers.*",)),
    ("settings", ("amp_patch.settings.*",)),
    ("ops", ("amp_patch.ops.*",)),
    ("scaler", ("amp_patch.scaler",)),
    ("optimizers", ("amp_patch.optim.*",)),
    ("model casting", ("amp_patch.casting.*",)),
    ("patching", ("amp_patch.patching.*",)),
    ("session", ("amp_patch.session",)),
    ("front end", ("amp_patch.frontend.*",)),
    ("apex_compat", ("amp_patch.apex_compat.*",)),
    ("public names", ("amp_patch", "amp_patch.optimizers")),
    ("cli", ("amp_patch.cli.*", "amp_patch.__main__")),
)

#: What each layer of :data:`LAYERS` holds, by layer name: the last column of docs/design.md's
#: layer table, which ``tools/layers_doc.py`` generates from the two.
ROLES: dict[str, str] = {
    "build": "the compiled kernels (`_C`), how they are built (`_buildspec`) and loaded for the "
             "running torch (`_native`)",
    "helpers": "torch-only helpers: logging set-up, DTensor local shards, grouping tensor lists "
               "by (device, dtype), verdicts every rank agrees on, gloo teardown",
    "settings": "the half dtypes and their names (and the names of the optimizer-state "
                "precisions), the opt-level registry, the frozen `Properties` and their "
                "validation (the CPU half modes among them), the frozen `Fp8Recipe`",
    "ops": "the op schemas, their reference bodies (the lean optimizer ops' state codes and "
           "stochastic rounding among them), the kernel loading, Apex's "
           "`multi_tensor_applier`",
    "scaler": "`AmpScaler`: scale and overflow flag as device tensors, the update rule",
    "optimizers": "`optim/fused`: the fused optimizers and their state formats; `optim/amp`: "
                  "optimizer records, masters (fp32 or bf16), patched `step`/`zero_grad`, "
                  "checkpoint hooks, LARC",
    "model casting": "O2/O3 casts and hooks; fitting FSDP2 states to the level; the FP8 "
                     "`nn.Linear` layers (`fp8`: their filter, forward, weight-cast cache and "
                     "delayed state, and the `fp8_autocast` regions' stack)",
    "patching": "O1's lists, wrappers, patcher and cast state; CPU half detection and "
                "emulation (`patching/cpu_half`); O1's weight casts on FSDP2's all-gathered "
                "params (`regather`)",
    "session": "`AmpSession`, the one global: what one `initialize` built, and its undo stack",
    "front end": "`initialize`, `scale_loss`, `init` (Apex's handle API), `clip_grad_norm_`, "
                 "checkpoints, `fp8_autocast` and `fp8_plan`, the ranks' decision check "
                 "(`AMP_PATCH_DEBUG_RANKS`)",
    "apex_compat": "Apex's names as thin faces over the parts below",
    "public names": "the `amp_patch` namespace and `amp_patch.optimizers`, the names users import",
    "cli": "the `amp-patch` command: `compare/`, `run/`, `doctor`",
}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` names ``target`` at ``line``."""

    source: str
    target: str
    line: int
    type_checking: bool


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module in ``path``, ``root`` being the package's directory."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the layer ``module`` belongs to; None if none."""
    best: tuple[int, int] | None = None  # (pattern length, layer)
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                base = pattern[:-2]
                hit = module == base or module.startswith(base + ".")
            else:
                hit = module == pattern
            if hit and (best is None or len(pattern) > best[0]):
                best = (len(pattern), index)
    return None if best is None else best[1]


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(path: Path, module: str, modules: set[str]) -> list[Import]:
    """The imports of package modules that the file at ``path`` (module ``module``) makes."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def add(target: str, line: int, type_checking: bool) -> None:
        # Name the deepest known module: "amp_patch.a.b.c" names amp_patch.a.b if c is a class.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.append(Import(module, target, line, type_checking))

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name, node.lineno, type_checking)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node)
            if base.split(".")[0] == PACKAGE:
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in modules else base, node.lineno, type_checking)
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, for the message."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(graph.get(node, ()) & members):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                if len(path) == 1:
                    return [start, node, start]
                return [start, *reversed(path[:-1]), start]
            if succ not in parents:
                parents[succ] = node
                queue.append(succ)
    return component


def check(root: Path) -> list[str]:
    """Every problem in the import graph of the package in directory ``root``; empty if none."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files) | {f"{PACKAGE}._C"}
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        rel = path.relative_to(root.parent)
        layer = layer_of(module)
        if layer is None:
            problems.append(f"{rel}: module {module} is in no layer; add it to LAYERS")
            continue
        folder = module.rpartition(".")[0] if path.name != "__init__.py" else module
        if folder != PACKAGE and layer_of(folder) != layer:
            problems.append(f"{rel}: module {module} ({LAYERS[layer][0]}) sits in the folder of "
                            f"another layer ({folder}); a folder is one layer")
        for imp in imports_of(path, module, modules):
            graph[module].add(imp.target)
            target_layer = layer_of(imp.target)
            if imp.type_checking or target_layer is None or target_layer <= layer:
                continue
            problems.append(
                f"{rel}:{imp.line}: {module} ({LAYERS[layer][0]}) imports {imp.target} "
                f"({LAYERS[target_layer][0]}), a higher layer")
    for component in _cycles(graph):
        problems.append("import cycle: " + " -> ".join(_path_within(graph, component))
                        + f" ({len(component)} modules: {', '.join(component)})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path,
                        default=Path(__file__).resolve().parent.parent / PACKAGE,
                        help="the package directory (default: the repository's amp_patch)")
    args = parser.parse_args(argv)
    problems = check(args.root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import-graph problem(s)", file=sys.stderr)
        return 1
    print("import graph: one-way, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
