"""The package layers only point down: no module imports a module of a higher layer (at the top of a
file, inside a function, or under TYPE_CHECKING), and the HTTP side never imports the in-process
`Engine` (nor the other way round).

Run alone: `python -m pytest -q tests/test_layers.py`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tide

# Lowest first. A module belongs to the longest prefix listed; it may import its own layer and below.
LAYERS: list[tuple[str, ...]] = [
    ("tide.config", "tide.model_config", "tide.sampling_params", "tide.io_struct", "tide.grammar",
     "tide.tokenizer", "tide.detokenizer", "tide.version", "tide.demo_model"),
    ("tide.memory", "tide.weights", "tide.parallel"),
    ("tide.executor.forward_batch",),  # what a forward reads: models and backends take it
    ("tide.layers",),
    ("tide.models",),
    ("tide.executor",),
    ("tide.scheduler",),
    # data parallel: the router and the controller `tide serve --dp-size` starts (scheduler processes)
    ("tide.cluster.router", "tide.cluster.dp_controller"),
    ("tide.engine", "tide.engine_io", "tide.async_calls", "tide.server"),
    # tide.cluster.ray: replicas holding an Engine
    ("tide.cli", "tide.__main__", "tide.diffusion", "tide.cluster", "tide"),
]
# Same layer, but neither side may import the other.
SEPARATE = [("tide.server", "tide.engine")]
# TYPE_CHECKING-only imports the architecture allows: the attention backends and the executor
# describe each other (a forward batch names its backend; a backend is created for a model runner).
ALLOWED_TYPE_ONLY = {
    ("tide.executor.forward_batch", "tide.layers.attention.base"),
    ("tide.layers.attention.base", "tide.executor.model_runner"),
    ("tide.layers.attention.triton_backend", "tide.executor.model_runner"),
    ("tide.layers.attention.torch_native", "tide.executor.model_runner"),
}


def _layer(module: str) -> tuple[int, str]:
    best = (-1, "")
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (rank, prefix)
    assert best[0] >= 0, f"{module} belongs to no layer: add it to LAYERS"
    return best


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module, module: str) -> list[tuple[str, int, bool]]:
    """(imported tide module, line, under TYPE_CHECKING) for every import in the file."""
    type_only_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if hasattr(sub, "lineno"):
                        type_only_lines.add(sub.lineno)
    found = []
    package = module if module == "tide" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from tide.layers import triton_ops` imports the submodule tide.layers.triton_ops
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                     for a in node.names]
        for name in names:
            if name == "tide" or name.startswith("tide."):
                found.append((name, node.lineno, node.lineno in type_only_lines))
    return found


def _is_module(name: str) -> bool:
    root = Path(tide.__file__).parent.parent
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _offenders() -> list[str]:
    root = Path(tide.__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        rank, prefix = _layer(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line, type_only in _imports(tree, module):
            target_rank, target_prefix = _layer(name)
            where = f"{path.relative_to(root.parent)}:{line}: {module} imports {name}"
            if type_only and (module, name) in ALLOWED_TYPE_ONLY:
                continue
            if target_rank > rank:
                out.append(f"{where} (layer {rank} -> {target_rank})")
            for a, b in SEPARATE:
                for src, dst in ((a, b), (b, a)):
                    if prefix == src and target_prefix == dst:
                        out.append(f"{where} ({src} must not import {dst})")
    return out


def test_no_upward_imports():
    offenders = _offenders()
    assert not offenders, "imports that point up:\n" + "\n".join(offenders)


def test_the_check_sees_an_upward_import():
    tree = ast.parse("from tide.scheduler.request import Req\n"
                     "def f():\n    from tide.engine import Engine\n")
    names = [name for name, _, _ in _imports(tree, "tide.layers.sampler")]
    assert names == ["tide.scheduler.request", "tide.engine"]
    assert _layer("tide.layers.sampler")[0] < _layer("tide.scheduler.request")[0]
    assert _layer("tide.executor.forward_batch")[0] < _layer("tide.models.llama")[0]


def test_life_of_a_request_names_what_exists():
    """docs/life_of_a_request.md names, in order, the files a token passes through: every file it
    names exists, and every code name it quotes is defined or used in tide."""
    root = Path(tide.__file__).parent.parent
    text = (root / "docs" / "life_of_a_request.md").read_text()
    paths = re.findall(r"`(tide/[\w/]+\.py)`", text)
    assert len(paths) >= 20
    missing = [p for p in paths if not (root / p).is_file()]
    assert not missing, f"life_of_a_request.md names files that do not exist: {missing}"
    names: set[str] = set()
    for path in (root / "tide").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    files = {path.name for path in (root / "tide").rglob("*.py")}
    quoted = re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", text)
    unknown = [q for q in quoted if not (q in files if q.endswith(".py") else all(
        part in names for part in q.removeprefix("tide.").split(".")))]
    assert not unknown, f"life_of_a_request.md quotes names the code does not have: {unknown}"
