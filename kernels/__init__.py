"""Numba CPU kernels (and their numpy references) for llamatune.

The threading policy they rely on (numba's OpenMP layer with a short spin, short OpenBLAS spin)
is set in llamatune/__init__.py, which always runs before this package.

numba's disk cache of compiled kernels goes to one folder per version of the kernels'
sources (~/.cache/llamatune/numba-<hash of kernels/*.py>, `kernel_cache_dir`): numba
checks a cached kernel against its own file only, so a kernel whose helpers in another
file changed (vecmath's expf, say) would otherwise keep running the old compiled code
after an upgrade or an edit. The folder is chosen (and created) when this package is
first imported, which every kernel module's import follows: numba picks a kernel's
cache folder when `@njit(cache=True)` decorates it. NUMBA_CACHE_DIR, when the user
set it, wins.
"""
import hashlib
import os
import sys
from importlib.util import find_spec
from pathlib import Path


def kernel_cache_dir() -> Path | None:
    """~/.cache/llamatune/numba-<16 hex digits of the hash of every kernels/*.py>
    (XDG_CACHE_HOME respected), created; None when it cannot be made."""
    spec = find_spec("llamatune.kernels")
    if spec is None or not spec.submodule_search_locations:
        return None
    digest = hashlib.sha256()
    for root in spec.submodule_search_locations:
        for f in sorted(Path(root).rglob("*.py")):
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(home) / "llamatune" / f"numba-{digest.hexdigest()[:16]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def use_kernel_cache_dir() -> None:
    """Point numba's disk cache at `kernel_cache_dir()` unless NUMBA_CACHE_DIR is set.
    numba reads the variable when it is imported; when it already was, its config is
    set too."""
    if "NUMBA_CACHE_DIR" in os.environ or (path := kernel_cache_dir()) is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    if "numba.core.config" in sys.modules:
        sys.modules["numba.core.config"].CACHE_DIR = str(path)


use_kernel_cache_dir()
