"""The layout's rules (docs/architecture.md), with no exemptions:

- imports go one way: cli > quickstart > commands > train > data > models > formats, and
  each may also import the core modules (llamatune/*.py) and llamatune.kernels;
- the core imports none of those packages (the package's __init__ included), the
  kernels nothing of llamatune but the kernels;
- no command imports another command;
- no circles among modules (imports inside functions count too);
- tests, bench and checks import each other normally, never through sys.path;
- importing the package, its command line and its kernel packages has no side
  effect beyond the threading policy's environment defaults: no cache folder, no
  numpy patch, numpy and numba not even loaded.
"""
import ast
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import llamatune

ROOT = Path(llamatune.__file__).parent
REPO = ROOT.parent
# subpackages, lowest first: each may import those before it (and the core and kernels)
ORDER = ["formats", "models", "data", "train", "commands", "quickstart", "cli"]


def package_roots() -> dict[str, Path]:
    """Where each top-level part of the `llamatune` namespace lives (kernels/ and cli/ are
    installed as llamatune.kernels and llamatune.cli)."""
    return {"llamatune": ROOT,
            **{name: Path(find_spec(name).submodule_search_locations[0])
               for name in ("llamatune.kernels", "llamatune.cli")}}


def module_files(roots: dict[str, Path] | None = None) -> dict[str, Path]:
    """Every module of the namespace by its dotted name."""
    files = {}
    for name, root in (roots or package_roots()).items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if name == "llamatune" and parts[0] in ("kernels", "cli"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([name, *parts])] = path
    return files


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The llamatune modules `module` (at `path`) imports, anywhere in the file: for
    `from P import N`, P.N when that is a module, else P."""
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in known and m != module}


def import_graph(roots: dict[str, Path] | None = None) -> dict[str, set[str]]:
    files = module_files(roots)
    return {m: imports_of(m, p, set(files)) for m, p in files.items()}


def layer(module: str) -> int | None:
    """Index in ORDER; None for the core modules (llamatune/*.py) and the kernels.
    llamatune.__main__ (`python -m llamatune`) is the command line's other entry: cli's."""
    parts = module.split(".")
    if parts[1:] == ["__main__"]:
        return ORDER.index("cli")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else None


def is_kernel(module: str) -> bool:
    return module.split(".")[:2] == ["llamatune", "kernels"]


def layering_errors(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for mod, imported in sorted(graph.items()):
        own = layer(mod)
        for dep in sorted(imported):
            theirs = layer(dep)
            if is_kernel(mod) and not is_kernel(dep):
                wrong.append(f"{mod} (a kernel) imports {dep}")
            elif theirs is not None and (own is None or theirs > own):
                wrong.append(f"{mod} imports {dep}, against the arrows")
            elif own == theirs == ORDER.index("commands") and mod != "llamatune.commands":
                wrong.append(f"{mod} (a command) imports the command {dep}")
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_imports_go_one_way():
    wrong = layering_errors(import_graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_circles():
    found = circles(import_graph())
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(g) for g in found)


def test_the_checks_see_wrong_imports(tmp_path):
    """The checker itself: a models/ module importing train/, a core module importing a
    package, a command importing a command, a kernel importing the library, and a circle."""
    files = {"models/probe.py": "from ..train import params\nfrom .config import ModelConfig\n",
             "models/config.py": "", "train/params.py": "from ..models import probe\n",
             "errors.py": "def f():\n    from .formats import peft\n", "formats/peft.py": "",
             "commands/a.py": "from .b import run\n", "commands/b.py": "run = 1\n"}
    for name, text in files.items():
        (tmp_path / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / name).write_text(text)
    (tmp_path / "kern").mkdir()
    (tmp_path / "kern" / "rope.py").write_text("from llamatune import options\n")
    (tmp_path / "lib" / "options.py").write_text("")
    graph = import_graph({"llamatune": tmp_path / "lib", "llamatune.kernels": tmp_path / "kern"})
    assert graph["llamatune.models.probe"] == {"llamatune.train.params", "llamatune.models.config"}
    assert layering_errors(graph) == [
        "llamatune.commands.a (a command) imports the command llamatune.commands.b",
        "llamatune.errors imports llamatune.formats.peft, against the arrows",
        "llamatune.kernels.rope (a kernel) imports llamatune.options",
        "llamatune.models.probe imports llamatune.train.params, against the arrows"]
    assert circles(graph) == [["llamatune.models.probe", "llamatune.train.params"]]


def sys_path_uses(path: Path) -> list[str]:
    """Places in a file that touch sys.path."""
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(path.parents[1])}:{n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
            and n.value.id == "sys"]


def test_tests_bench_and_checks_never_touch_sys_path():
    found = [use for folder in ("tests", "bench", "checks") for path in sorted((REPO / folder).rglob("*.py"))
             for use in sys_path_uses(path)]
    assert not found, "sys.path changed in: " + ", ".join(found)


def test_sys_path_check_sees_an_insert(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "t.py").write_text("import sys\nsys.path.insert(0, 'tests')\n")
    assert sys_path_uses(tmp_path / "bench" / "t.py") == ["bench/t.py:2"]


def test_bench_measures_and_checks_verify():
    """bench/ holds measurements only: no tool there is named as a check."""
    verifying = ("fuzz", "crosscheck", "vocab_suites", "memory_check", "arch_reference")
    assert not [p.name for p in (REPO / "bench").glob("*.py") if any(v in p.name for v in verifying)]
    assert all((REPO / "checks" / f"{v}.py").exists() for v in ("fuzz", "fuzz_mutate", "llamacpp_crosscheck",
                                                                 "arch_crosscheck", "vocab_suites", "memory_check"))


PROBE = """
import json, os, sys
import llamatune, llamatune.cli.main, llamatune.options, llamatune.outputs
first = {"numpy": "numpy" in sys.modules, "numba": "numba" in sys.modules,
         "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR"), "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
         "files": sorted(os.listdir(sys.argv[1]))}
import numpy as np
np.__dict__.pop("row_stack", None)          # so that an alias added by the import would show
import llamatune.kernels.cuda
first["row_stack"] = hasattr(np, "row_stack")
print(json.dumps(first))
"""


def test_import_has_no_side_effects(tmp_path):
    """`import llamatune` and its command line create no cache folder, set no
    NUMBA_CACHE_DIR and load neither numpy nor numba; they set only the threading
    policy's defaults. Importing the CUDA kernel package patches nothing in numpy."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "GOMP_SPINCOUNT")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    res = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"numpy": False, "numba": False, "NUMBA_CACHE_DIR": None,
                                      "GOMP_SPINCOUNT": "2000", "files": [], "row_stack": False}


def missing_sources(doc: str, files: list[str]) -> list[str]:
    """Python files a document names (paths, bare names or patterns) that match no file;
    a pattern must match more than its plain name (`convert*.py` is not `convert.py`)."""
    import re
    from pathlib import PurePosixPath
    missing = []
    for name in sorted(set(re.findall(r"[\w./*-]+\.py\b", doc))):
        name = name.lstrip("./")
        if "*" in name:
            plain = name.replace("*", "")
            found = any(PurePosixPath(f).match(name) and not f.endswith(plain) for f in files)
        else:
            found = any(f == name or f.endswith("/" + name) for f in files)
        if not found:
            missing.append(name)
    return missing


def test_architecture_doc_names_only_files_that_exist():
    files = [p.relative_to(REPO).as_posix() for folder in ("llamatune", "kernels", "cli", "tests", "bench", "checks")
             for p in (REPO / folder).rglob("*.py")]
    assert missing_sources((REPO / "docs" / "architecture.md").read_text(), files) == []
    assert missing_sources("`convert*.py`, kernels/*.py, `step.py`, old/legacy.py",
                           ["llamatune/commands/convert.py", "kernels/rope.py", "llamatune/train/step.py"]) \
        == ["convert*.py", "old/legacy.py"]
