"""grpokit's layering: every arrow points down.

Each package under src/grpokit sits in a layer. A module may import its own package and the packages
that ALLOWED lists for it, all in lower layers, so no import points up or sideways and no cycle can
form. Lazy imports (in functions) count;
`if TYPE_CHECKING:` blocks do not, since they never run. Imports are read with `ast`, never executed.

The pure math's stricter rule (only torch and the stdlib) is checked file by file in
tests/test_objectives.py::test_pure_modules_import_only_torch_and_stdlib; here only its package-wide
part (no transformers in grpokit.algorithms) and grpokit.config's (no torch, no transformers).
"""

from __future__ import annotations

import ast
import functools
import warnings
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src" / "grpokit"
LONG_LINES = 400  # over this a module gets a warning: is it still one job? split it by meaning, not by size
MAX_LINES = 600   # over this the test fails

# The layers, lowest first. Each layer is everything below it plus its own packages.
L0 = {"errors", "processes", "exit_guard"}
L1 = L0 | {"config"}
L2 = L1 | {"algorithms", "data", "rewards"}
L3 = L2 | {"tasks", "models"}
L4 = L3 | {"observe", "rollout"}
L5 = L4 | {"training"}
ENTRY_POINTS = {"cli", "demo", "demo_tools", "demo_vision", "sft", "evaluate", "trl", "serve"}
LAYERS = [L0, L1, L2, L3, L4, L5, L5 | ENTRY_POINTS | {"grpokit"}]

# Each package, and the other packages it may import. A package may always import its own modules.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),                           # 0
    "processes": set(),                        # 0  every child process: start, heartbeat, deadline, stop
    "exit_guard": set(),                       # 0  user code's exits in the trainer's process (tools, rewards)
    "config": L0,                              # 1  (and neither torch nor transformers)
    "algorithms": L1,                          # 2  pure torch (no transformers)
    "data": L1,                                # 2
    "rewards": L1,                             # 2
    "tasks": L2,                               # 3  rewards, data, ...
    "models": L2,                              # 3  algorithms, ...
    "observe": L3,                             # 4  models, data, rewards, algorithms, config
    "rollout": L3,                             # 4  the same, never each other
    "training": L4,                            # 5
    "evaluate": L5,                            # 6  entry points
    "sft": L5,                                 # 6
    "trl": L5,                                 # 6  the TRL drop-in (grpokit.trl), over training's loop
    "serve": L5,                               # 6  `grpokit serve`: starts vLLM's server
    "demo": L5 | {"evaluate", "sft"},          # 6  the demo runs sft, then evaluates
    "demo_tools": L5 | {"demo", "evaluate", "sft"},  # 7  the tool demo, sharing the demo's display
    "demo_vision": L5 | {"demo", "evaluate", "sft"},  # 7  the visual demo, sharing the demo's display
    "cli": L5 | {"demo", "demo_tools", "demo_vision", "evaluate", "sft", "serve"},  # 8  dispatches to the others
    "grpokit": L5 | ENTRY_POINTS,              # the root, grpokit/__init__.py: anything, lazily
}
FORBIDDEN_OUTSIDE = {"config": {"torch", "transformers"}, "algorithms": {"transformers"}}


class Import(NamedTuple):
    module: str   # the importing module, e.g. grpokit.rollout.decode
    line: int
    target: str   # the imported module under the package, or an outside module's top name (torch)
    inside: bool  # whether target is under the scanned package
    lazy: bool    # whether the import is inside a function body

    def __str__(self):
        return f"{self.module}:{self.line} imports {self.target}"


def package_of(module: str) -> str:
    """grpokit.rollout.decode -> rollout; grpokit.cli -> cli; grpokit -> grpokit (the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(package: str) -> int:
    return next(i for i, packages in enumerate(LAYERS) if package in packages)


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, package: str, known: set[str]):
        self.module, self.package, self.known = module, package, known
        self.top, self.depth, self.found = module.split(".")[0], 0, []

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        test = node.test  # `if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`; its else branch does run
        if getattr(test, "id", getattr(test, "attr", None)) != "TYPE_CHECKING":
            return self.generic_visit(node)
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node):
        for alias in node.names:  # `import grpokit.x.y as z` imports grpokit.x.y
            self._add(node, alias.name)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:  # relative: resolve against the package the file is in
            parts = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(parts + [node.module] * bool(node.module))
        for alias in node.names:  # `from grpokit.a import b` imports grpokit.a.b when that is a module
            sub = f"{base}.{alias.name}"  # and `from . import b` in an __init__ can only mean a module
            self._add(node, sub if sub in self.known or (node.module is None and base == self.module) else base)

    def _add(self, node, name: str):
        inside = name == self.top or name.startswith(self.top + ".")
        if name != self.module:
            self.found.append(Import(self.module, node.lineno, name if inside else name.split(".")[0],
                                     inside, self.depth > 0))


def scan(root: Path) -> tuple[dict[str, Path], list[Import]]:
    """Every module under the package folder root (name -> file), and every import they make."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        visitor = _Imports(module, package, set(files))
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        imports += visitor.found
    return files, imports


def on_cycles(arrows: list[tuple]) -> list[tuple]:
    """The arrows (a, b, ...) that lie on a cycle, that is, those where b leads back to a."""
    succ: dict[str, set[str]] = {}
    for a, b, *_ in arrows:
        succ.setdefault(a, set()).add(b)
    reach = {}
    for start in succ:
        seen, todo = set(), [start]
        while todo:
            for nxt in succ.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    return [arrow for arrow in arrows if arrow[0] in reach.get(arrow[1], ())]


def cycles(files, imports, node=str) -> list[str]:
    """One import for each arrow on a cycle of the graph of node(module): modules, or (package_of) packages."""
    arrows = [(node(i.module), node(i.target), i) for i in imports if i.inside and i.target in files]
    first = {}
    for a, b, i in sorted(on_cycles(arrows), key=lambda arrow: (arrow[2].module, arrow[2].line)):
        first.setdefault((a, b), i)
    return sorted(str(i) for (a, b), i in first.items() if a != b)


def layer_violations(files, imports) -> list[str]:
    bad = []
    for i in imports:
        src = package_of(i.module)
        if not i.inside:
            if i.target in FORBIDDEN_OUTSIDE.get(src, ()):
                bad.append(f"{i}: grpokit.{src} must not import {i.target}")
            continue
        dst = package_of(i.target)
        if i.target not in files:
            bad.append(f"{i}: no such module under src/grpokit")
        elif src not in ALLOWED or dst not in ALLOWED:
            bad.append(f"{i}: add {src if src not in ALLOWED else dst} to the ALLOWED table")
        elif src != dst and dst not in ALLOWED[src]:
            bad.append(f"{i}: {src} (layer {layer(src)}) may not import {dst} (layer {layer(dst)})")
        elif src == "grpokit" and not i.lazy:
            bad.append(f"{i}: the package root imports only lazily, inside functions")
    return sorted(set(bad))  # `from x import a, b` gives one line


def long_modules(files, limit: int) -> list[str]:
    """The modules over `limit` lines, with their lengths."""
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in files.items()}
    return sorted(f"{module}: {n} lines" for module, n in lengths.items() if n > limit)


@functools.cache
def _grpokit():
    return scan(SRC)


def _fail(title: str, lines: list[str]) -> str:
    return f"{title} ({len(lines)}):\n  " + "\n  ".join(lines)


def test_no_module_import_cycles():
    bad = cycles(*_grpokit())
    assert not bad, _fail("imports on a module cycle (lazy imports count)", bad)


def test_every_arrow_points_down():
    bad = layer_violations(*_grpokit())
    assert not bad, _fail("imports against the layering (see ALLOWED)", bad)


def test_package_graph_is_acyclic():
    bad = cycles(*_grpokit(), node=package_of)
    assert not bad, _fail("imports on a package cycle (one per package arrow)", bad)


def test_modules_are_short():
    """Over LONG_LINES a warning naming the modules (a long module may be one job); over MAX_LINES a failure."""
    files = _grpokit()[0]
    too_long = long_modules(files, MAX_LINES)
    assert not too_long, _fail(f"modules over {MAX_LINES} lines", too_long)
    long = long_modules(files, LONG_LINES)
    if long:
        warnings.warn(_fail(f"modules over {LONG_LINES} lines: still one job each?", long), stacklevel=1)


def test_allowed_table_covers_every_package_and_points_down():
    files, _ = _grpokit()
    assert {package_of(m) for m in files} <= set(ALLOWED), "add the new packages to ALLOWED"
    assert not on_cycles([(p, q) for p, qs in ALLOWED.items() for q in qs])
    assert all(layer(q) <= layer(p) for p, qs in ALLOWED.items() for q in qs)


def test_checker_catches_synthetic_violations(tmp_path):
    fake = {
        "__init__.py": "from grpokit.cli import main\n",                       # eager import in root
        "cli.py": "",
        "errors.py": "x = 1\n" * (MAX_LINES + 1),                              # too long
        "processes.py": "x = 1\n" * (LONG_LINES + 1),                         # long: a warning
        "config/__init__.py": "import torch\nfrom grpokit.training import loop\n",  # torch; upward
        "algorithms/__init__.py": "import typing\nif typing.TYPE_CHECKING:\n"
                                  "    import transformers\n    from grpokit import training\n",
        "rewards/__init__.py": "",
        "rewards/a.py": "from . import b\n",                                   # a -> b -> a
        "rewards/b.py": "def f():\n    import grpokit.rewards.a as a\n",
        "observe/__init__.py": "from grpokit.rollout import engines\n",         # sideways, wrong way
        "rollout/__init__.py": "",
        "rollout/engines.py": "from ..observe import metrics\n",                # sideways too: a cycle
        "training/__init__.py": "",
        "training/loop.py": "from ..models import gone\n",                       # no such module
    }
    for name, text in fake.items():
        path = tmp_path / "grpokit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    files, imports = scan(tmp_path / "grpokit")

    assert cycles(files, imports) == [
        "grpokit.observe:1 imports grpokit.rollout.engines",
        "grpokit.rewards.a:1 imports grpokit.rewards.b",
        "grpokit.rewards.b:2 imports grpokit.rewards.a",
        "grpokit.rollout.engines:1 imports grpokit.observe",
    ]
    assert cycles(files, imports, node=package_of) == [  # the rewards cycle stays inside its package
        "grpokit.observe:1 imports grpokit.rollout.engines", "grpokit.rollout.engines:1 imports grpokit.observe"]
    assert layer_violations(files, imports) == [
        "grpokit.config:1 imports torch: grpokit.config must not import torch",
        "grpokit.config:2 imports grpokit.training.loop: config (layer 1) may not import training (layer 5)",
        "grpokit.observe:1 imports grpokit.rollout.engines: observe (layer 4) may not import rollout (layer 4)",
        "grpokit.rollout.engines:1 imports grpokit.observe: rollout (layer 4) may not import observe (layer 4)",
        "grpokit.training.loop:1 imports grpokit.models: no such module under src/grpokit",
        "grpokit:1 imports grpokit.cli: the package root imports only lazily, inside functions",
    ]
    assert long_modules(files, MAX_LINES) == [f"grpokit.errors: {MAX_LINES + 1} lines"]
    assert long_modules(files, LONG_LINES) == [f"grpokit.errors: {MAX_LINES + 1} lines",
                                               f"grpokit.processes: {LONG_LINES + 1} lines"]
