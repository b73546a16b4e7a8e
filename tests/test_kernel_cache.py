"""numba's disk cache of the kernels lives in one folder per version of their sources
(llamatune.kernels.kernel_cache_dir): numba checks a cached kernel against its own file only."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import llamatune.kernels as kernels


def test_cache_folder_follows_every_kernel_source(tmp_path, monkeypatch):
    src = tmp_path / "kernels"
    (src / "cuda").mkdir(parents=True)
    (src / "vecmath.py").write_text("def expf(x): return x\n")
    (src / "cross_entropy.py").write_text("from .vecmath import expf\n")
    (src / "cuda" / "rope.py").write_text("x = 1\n")
    monkeypatch.setattr(kernels, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(src)]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = kernels.kernel_cache_dir()
    assert first.parent == tmp_path / "cache" / "llamatune" and first.name.startswith("numba-") and first.is_dir()
    assert kernels.kernel_cache_dir() == first
    (src / "vecmath.py").write_text("def expf(x): return x + 0\n")        # a helper in another file
    second = kernels.kernel_cache_dir()
    assert second != first
    (src / "cuda" / "rope.py").write_text("x = 2\n")
    assert kernels.kernel_cache_dir() not in (first, second)


def test_cache_folder_unwritable_leaves_numba_its_default(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert kernels.kernel_cache_dir() is None


def test_kernels_import_sets_numba_cache_dir_unless_the_user_did(tmp_path, monkeypatch):
    """Set when the kernels are first imported (before numba or after it), not by `import llamatune`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = kernels.kernel_cache_dir()
    assert want.parent == tmp_path / "llamatune"
    code = ("import os, llamatune; print(os.environ.get('NUMBA_CACHE_DIR')); import numba.core.config as c; "
            "import llamatune.kernels; print(os.environ.get('NUMBA_CACHE_DIR'), c.CACHE_DIR)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", str(want), str(want)]
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(tmp_path / "mine")] * 3
