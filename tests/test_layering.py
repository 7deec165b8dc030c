"""The layers import downward only: a module imports its own layer or layers below it, in the order
a request travels (docs/architecture.md). Imports under `if TYPE_CHECKING:` are type hints, not
dependencies, and are not counted; every other exception is listed below with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import roseinfer

PACKAGE = Path(roseinfer.__file__).parent

# Top to bottom. A module belongs to the first layer one of whose prefixes it starts with.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("roseinfer.cli", "roseinfer.bench", "roseinfer.offline_example", "roseinfer.server.__main__",
                      "roseinfer.worker.__main__", "roseinfer.__init__", "roseinfer.seed_api")),
    ("server", ("roseinfer.server",)),
    ("engine", ("roseinfer.engine",)),
    ("core", ("roseinfer.core",)),
    ("executor", ("roseinfer.executor",)),
    ("worker", ("roseinfer.worker",)),
    ("models", ("roseinfer.models",)),
    ("layers", ("roseinfer.layers", "roseinfer.distributed")),
    ("text", ("roseinfer.structured_output", "roseinfer.tool_parsers", "roseinfer.reasoning",
              "roseinfer.multimodal", "roseinfer.tokenizer", "roseinfer.gguf_tokenizer", "roseinfer.detokenizer", "roseinfer.chat_template", "roseinfer.chat_format", "roseinfer.special_token_guard")),
    ("common", ("roseinfer.common",)),
    ("configuration and plain data", ("roseinfer.config", "roseinfer.errors", "roseinfer.sampling_params",
                                      "roseinfer.pooling_params", "roseinfer.outputs", "roseinfer.heap",
                                      "roseinfer.step_timings", "roseinfer.structured_output_params",
                                      "roseinfer.grammar_limits")),
]

# (importer, imported): why it may run up.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """The roseinfer modules `path` imports, with their line numbers, type-checking blocks left out."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    type_checking = {
        id(node) for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for child in block.body for node in ast.walk(child)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from roseinfer.x import y` where y is a module counts as importing roseinfer.x.y
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.append((candidate if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                              or (PACKAGE.parent / candidate.replace(".", "/")).is_dir() else target, node.lineno))
    return [(name, line) for name, line in found if name == "roseinfer" or name.startswith("roseinfer.")]


def test_every_import_runs_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        if importer == "roseinfer":
            continue  # the package's face re-exports the public API from every layer
        for imported, line in imports(path):
            if imported == "roseinfer" or (importer, imported) in EXCEPTIONS:
                continue
            if layer_of(imported) < layer_of(importer):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} {importer} ({LAYERS[layer_of(importer)][0]}) "
                              f"imports {imported} ({LAYERS[layer_of(imported)][0]})")
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def test_the_exceptions_are_still_needed():
    seen = {(module_name(path), imported) for path in PACKAGE.rglob("*.py") for imported, _ in imports(path)}
    stale = [pair for pair in EXCEPTIONS if pair not in seen]
    assert not stale, f"exceptions no import needs any more: {stale}"
