"""The package layout's one rule: imports go one way (docs/architecture.md)."""
import ast
from pathlib import Path

import llamatune

ROOT = Path(llamatune.__file__).parent
ORDER = ["formats", "models", "train", "commands"]      # each may import those before it


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Fully qualified llamatune modules a file imports (relative imports resolved)."""
    pkg = ["llamatune", *path.relative_to(root).parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("llamatune.")}


def layer(module: str) -> int | None:
    """Index in ORDER of a module's subpackage; None for core modules and kernels."""
    parts = module.split(".")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else None


def test_imports_go_one_way():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        own = layer(".".join(["llamatune", *path.relative_to(ROOT).with_suffix("").parts]))
        if path == ROOT / "__init__.py":
            continue                                  # the package root starts the thread policy
        for mod in imports_of(path):
            theirs = layer(mod)
            if theirs is None:
                continue
            if own is None or theirs > own:
                wrong.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    """The checker itself: a models/ file importing train/ is reported."""
    bad = tmp_path / "models" / "probe.py"
    bad.parent.mkdir()
    bad.write_text("from ..train import params\nfrom .config import ModelConfig\n")
    found = imports_of(bad, tmp_path)
    assert {"llamatune.train.params", "llamatune.models.config"} <= found
    assert layer("llamatune.train.params") > layer("llamatune.models.probe")
