"""The one layer that touches GGUF file bytes.

Reading goes through `gguf.GGUFReader` (memory-mapped: tensor data stays on disk
until a kernel reads it); writing goes through `gguf.GGUFWriter`, streamed tensor
by tensor and always atomic (temporary file, flush, fsync, rename).

Shapes: GGUF stores dimensions innermost-first (ggml `ne`); everything outside this
module uses numpy order (rows, cols). The reversal happens here and nowhere else.
A weight `W` of a linear layer `y = x W^T` is `(n_out, n_in)` in numpy order, i.e.
ggml ne `[n_in, n_out]`.
"""
from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from ..errors import LlamatuneError


class GGUFError(LlamatuneError):
    """A GGUF file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file; `data` is a memory-mapped view, never a copy."""
    name: str
    qtype: QType
    shape: tuple[int, ...]   # numpy order: (..., n_rows, n_cols); n_cols is ggml ne[0]
    data: np.ndarray         # as gguf-py exposes it: typed for F32/F16, uint8 bytes otherwise

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    def raw_rows(self) -> np.ndarray:
        """The bytes as a uint8 (n_rows, row_bytes) view: the input of every dequant kernel."""
        return self.data.reshape(-1).view(np.uint8).reshape(self.n_rows, -1)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class KV(NamedTuple):
    """One metadata key/value with its GGUF types, so it can be copied exactly."""
    key: str
    value: Any
    vtype: VType
    sub_type: VType | None = None


class _Problem(Exception):
    """A structural problem found while parsing; GGUFFile prefixes the file name."""


GGML_MAX_DIMS = 4            # ggml tensors have at most 4 dimensions
GGML_MAX_NAME = 64           # and names of at most 63 bytes (ggml.h)
_MIN_KV_BYTES = 8 + 4 + 1    # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dim, type, offset


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that validates the file's structure while parsing it, so a bad file
    is reported by what is wrong (key, tensor, byte offset) instead of a numpy error:

    - counts (metadata keys, tensors, array lengths, string lengths) against the
      bytes left in the file, so a huge count fails at once instead of looping;
    - duplicate metadata keys and tensor names; `general.alignment` a UINT32 power of 2;
    - each tensor: 1..4 dimensions, each at least 1; a known ggml type; columns a
      multiple of the type's block size; data offset aligned to `general.alignment`
      (default 32); data inside the file and not overlapping another tensor.

    It also reads metadata arrays in bulk (gguf-py walks them element by element,
    about 13 s for a 128k-token vocabulary; this takes well under a second)."""

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > (len(self.data) - offs) // _MIN_KV_BYTES:
            raise _Problem(f"corrupt or truncated GGUF header: it claims {int(count)} metadata keys, "
                           "more than the file can hold")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int):
        if int(count) > (len(self.data) - offs) // _MIN_TENSOR_INFO_BYTES:
            raise _Problem(f"corrupt or truncated GGUF header: it claims {int(count)} tensors, "
                           "more than the file can hold")
        return super()._build_tensor_info(offs, count)

    def _push_field(self, field, skip_sum: bool = False) -> int:
        if not field.name.isprintable():
            raise _Problem(f"metadata key {field.name[:80]!r} holds control characters")
        if field.name in self.fields:
            raise _Problem(f"metadata key '{field.name}' appears twice")
        if field.name == "general.alignment":
            if field.types != [VType.UINT32]:
                raise _Problem(f"metadata key 'general.alignment' has type "
                               f"{'/'.join(t.name for t in field.types)}, expected UINT32")
            align = int(field.parts[-1][0])
            if align == 0 or align & (align - 1):
                raise _Problem(f"metadata key 'general.alignment' is {align}, expected a power of 2")
        return super()._push_field(field, skip_sum)

    def _get_str(self, offset: int):
        length = self._get(offset, np.uint64)
        if len(length) and int(length[0]) > len(self.data) - offset - 8:
            raise _Problem(f"string at byte {offset} claims {int(length[0])} bytes, past the end of the file")
        return super()._get_str(offset)

    def _get_tensor_info_field(self, orig_offs: int):
        name_len = self._get(orig_offs, np.uint64)
        if len(name_len):
            n_dims = self._get(orig_offs + 8 + min(int(name_len[0]), len(self.data)), np.uint32)
            if len(n_dims) and not 1 <= int(n_dims[0]) <= GGML_MAX_DIMS:
                name = self._get_str(orig_offs)[1].tobytes().decode("utf-8", "replace")[:80]
                raise _Problem(f"tensor {name!r} has {int(n_dims[0])} dimensions, expected 1 to {GGML_MAX_DIMS}")
        return super()._get_tensor_info_field(orig_offs)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if int(raw_type) not in set(VType):
            raise _Problem(f"metadata value at byte {orig_offs} has unknown type id {int(raw_type)}")
        if raw_type != VType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(alen) == 0:
            raise _Problem(f"array at byte {orig_offs} runs past the end of the file")
        try:
            itype = VType(int(raw_itype[0]))
        except ValueError:
            raise _Problem(f"array at byte {orig_offs} has unknown element type {int(raw_itype[0])}") from None
        n, offs = int(alen[0]), orig_offs + 12
        if n > len(self.data) - offs:       # every element takes at least one byte
            raise _Problem(f"array at byte {orig_offs} claims {n} elements, more than the file can hold")
        parts: list = [raw_itype, alen]
        if itype == VType.STRING:
            buf, end = memoryview(self.data), len(self.data)
            idxs = []
            for _ in range(n):
                length = int.from_bytes(buf[offs:offs + 8], "little")
                if offs + 8 + length > end:
                    raise _Problem(f"string array at byte {orig_offs} runs past the end of the file")
                parts += [buf[offs:offs + 8], buf[offs + 8:offs + 8 + length]]   # (length, bytes) like gguf-py
                idxs.append(len(parts) - 1)
                offs += 8 + length
            return offs - orig_offs, parts, idxs, [VType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:          # nested arrays: rare, let gguf-py handle them
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        if len(values) != n:
            raise _Problem(f"array at byte {orig_offs} runs past the end of the file")
        return 12 + int(values.nbytes), parts + [values], [2], [VType.ARRAY, itype]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_size = len(self.data)
        align = int(self.alignment)
        extents, names = [], set()
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            if len(bytes(name_data)) >= GGML_MAX_NAME or not name.isprintable():
                raise _Problem(f"tensor name {name[:80]!r} is not a name of at most {GGML_MAX_NAME - 1} "
                               "printable characters")
            if name in names:
                raise _Problem(f"duplicate tensor name {name}")
            names.add(name)
            try:
                qtype = QType(int(raw_dtype[0]))
            except ValueError:
                raise _Problem(f"tensor '{name}' has unknown ggml type id {int(raw_dtype[0])}") from None
            if qtype not in gguf.GGML_QUANT_SIZES:
                raise _Problem(f"tensor '{name}' has ggml type {qtype.name}, which has no known block layout")
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            ne = [int(d) for d in dims]
            if min(ne) < 1:
                raise _Problem(f"tensor '{name}' has dimensions {ne}; each must be at least 1")
            if ne[0] % block:
                raise _Problem(f"tensor '{name}' has {ne[0]} columns, not a multiple of the "
                               f"{qtype.name} block size {block}")
            n_bytes = math.prod(ne) // block * type_size          # Python ints: no overflow
            off = int(offset[0])
            if off % align:
                raise _Problem(f"tensor '{name}' data offset {off} is not a multiple of the alignment {align}")
            end = int(start_offs) + off + n_bytes
            if end > file_size:
                raise _Problem(f"tensor '{name}' data ends at byte {end} but the file has only "
                               f"{file_size} bytes (truncated file?)")
            extents.append((off, off + n_bytes, name))
        extents.sort()
        for (_, end_a, name_a), (start_b, _, name_b) in zip(extents, extents[1:]):
            if start_b < end_a:
                raise _Problem(f"tensors '{name_a}' and '{name_b}' overlap in the file")
        super()._build_tensors(start_offs, fields)


def describe(value: Any) -> str:
    """A short description of a metadata value for error messages: `a string 'abc'`, `a list of 3`."""
    if isinstance(value, str):
        return f"a string {value[:20]!r}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, bool):
        return f"a boolean {value}"
    return f"{type(value).__name__} {value!r}"[:40]


def check_int(value: Any, lo: int, hi: int, what: str) -> int:
    """`value` as an int in [lo, hi]; else a GGUFError starting with `what` (file and key)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{what} is {describe(value)}, expected an integer")
    if not lo <= int(value) <= hi:
        raise GGUFError(f"{what} is {int(value)}, expected {lo} to {hi}")
    return int(value)


F32_MAX = float(np.finfo(np.float32).max)


def check_float(value: Any, what: str) -> float:
    """`value` as a float finite in float32; else a GGUFError starting with `what` (file and key)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GGUFError(f"{what} is {describe(value)}, expected a number")
    if not abs(float(value)) <= F32_MAX:
        raise GGUFError(f"{what} is {float(value):g}, expected a finite float32 number")
    return float(value)


class GGUFFile:
    """A GGUF file opened memory-mapped: metadata as Python values, tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise GGUFError(f"{self.path}: file not found")
        if self.path.is_dir():
            raise GGUFError(f"{self.path}: is a directory, expected a .gguf file")
        size = self.path.stat().st_size
        if size == 0:
            raise GGUFError(f"{self.path}: file is empty, expected a GGUF file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        if size < 24:
            raise GGUFError(f"{self.path}: truncated GGUF header ({size} bytes, at least 24 expected)")
        with open(self.path, "rb") as f:
            version = int.from_bytes(f.read(8)[4:], "little")
        if version not in (2, 3):
            order = " (a big-endian file? only little-endian GGUF is supported)" if version & 0xFFFF == 0 else ""
            raise GGUFError(f"{self.path}: GGUF version {version}{order}; versions 2 and 3 are supported")
        try:
            reader = _CheckedReader(self.path, "r")
        except _Problem as e:
            raise GGUFError(f"{self.path}: {e}") from None
        except (ValueError, IndexError, OverflowError, UnicodeDecodeError, KeyError) as e:
            detail = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF header ({detail})") from None
        self._reader = reader
        self.kvs: dict[str, KV] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            vtype = field.types[0] if field.types else None
            sub = field.types[-1] if vtype == VType.ARRAY and len(field.types) > 1 else None
            try:
                value = field.contents()
            except (ValueError, UnicodeDecodeError) as e:
                raise GGUFError(f"{self.path}: metadata key '{name}' cannot be read ({e})") from None
            self.kvs[name] = KV(name, value, vtype, sub)
        self.tensors: dict[str, Tensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = Tensor(t.name, QType(t.tensor_type), shape, t.data)

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapped file; a later read of a tensor
        pages it in again (full finetuning: the trained tensors were copied out once)."""
        mapping = getattr(self._reader.data, "_mmap", None)        # np.memmap's mmap object
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    @property
    def metadata(self) -> dict[str, Any]:
        return {k: kv.value for k, kv in self.kvs.items()}

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        return default if kv is None else kv.value

    def require(self, key: str) -> Any:
        kv = self.kvs.get(key)
        if kv is None:
            raise GGUFError(f"{self.path}: missing required metadata key '{key}'")
        return kv.value

    def get_str(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A string value; `default` when absent (an error when `required`)."""
        value = self.require(key) if required else self.get(key, default)
        if value is not default and not isinstance(value, str):
            raise GGUFError(f"{self.path}: metadata key '{key}' is {describe(value)}, expected a string")
        return value

    def get_int(self, key: str, default: Any = None, lo: int = 0, hi: int = 2**63 - 1,
                required: bool = False) -> Any:
        """An integer value in [lo, hi]; `default` when absent (an error when `required`)."""
        value = self.require(key) if required else self.get(key, default)
        if value is default:
            return value
        return check_int(value, lo, hi, f"{self.path}: metadata key '{key}'")

    def get_float(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A number finite as a float32 (integers accepted; llama.cpp reads such keys into
        float32); `default` when absent (an error when `required`)."""
        value = self.require(key) if required else self.get(key, default)
        if value is default:
            return value
        return check_float(value, f"{self.path}: metadata key '{key}'")

    @property
    def arch(self) -> str:
        return self.get_str("general.architecture", required=True)

    def tensor(self, name: str) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: missing tensor '{name}'")
        return t

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


# --------------------------------------------------------------------------- writing

@dataclass
class TensorOut:
    """A tensor to write. `make()` returns its data when the writer streams it:
    float32/float16 arrays in numpy order, or uint8 (n_rows, row_bytes) for
    quantized types. Producing data lazily keeps big merges out of memory."""
    name: str
    shape: tuple[int, ...]          # numpy order
    qtype: QType
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // block * type_size


def tensor_out(name: str, array: np.ndarray, qtype: QType | None = None) -> TensorOut:
    """A TensorOut for an in-memory array (F32/F16 inferred from dtype)."""
    if qtype is None:
        qtype = {np.dtype(np.float32): QType.F32, np.dtype(np.float16): QType.F16}[array.dtype]
    if array.dtype == np.uint8:
        shape = tuple(gguf.quant_shape_from_byte_shape(array.shape, qtype))
    else:
        shape = tuple(array.shape)
    return TensorOut(name, shape, qtype, lambda: array)


def kv(key: str, value: Any, vtype: VType | None = None, sub_type: VType | None = None) -> KV:
    """A KV with its GGUF type inferred the way llama.cpp writes such keys."""
    if vtype is None:
        if isinstance(value, bool):
            vtype = VType.BOOL
        elif isinstance(value, (int, np.integer)):
            vtype = VType.UINT32
        elif isinstance(value, (float, np.floating)):
            vtype = VType.FLOAT32
        elif isinstance(value, str):
            vtype = VType.STRING
        elif isinstance(value, (list, tuple)):
            vtype = VType.ARRAY
        else:
            raise TypeError(f"cannot infer GGUF type of {key}={value!r}")
    if vtype == VType.ARRAY and sub_type is None:
        first = value[0] if len(value) else ""
        sub_type = kv("_", first).vtype
    return KV(key, value, vtype, sub_type)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it and rename it over
    `path`, on any failure delete it. Readers never see a half-written file, and a
    file that was there before stays as it was. An OSError on the way (disk full,
    no permission) becomes one LlamatuneError line naming `path`."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; outputs get the usual permissions
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise


def write_error(path: str | os.PathLike, e: OSError) -> LlamatuneError:
    """The one line for a failed write: 'PATH: cannot write (no space left on device); ...'."""
    problem = (e.strerror or str(e) or type(e).__name__).lower()
    return LlamatuneError(f"{path}: cannot write ({problem}); any earlier version of it is left as it was")


ALIGNMENT = 32                       # GGUF's default data alignment, as write_gguf leaves it


def kv_nbytes(kvs: Iterable[KV]) -> int:
    """Bytes the metadata `kvs` take in a GGUF header (strings as their UTF-8, numbers
    at most 8 bytes: an upper bound within a few bytes a key)."""
    def value(v: Any) -> int:
        if isinstance(v, str):
            return 8 + len(v.encode("utf-8"))
        if isinstance(v, (list, tuple)):
            return 12 + sum(value(x) for x in v)
        return 8
    return sum(8 + len(k.key) + 4 + value(k.value) for k in kvs)


def gguf_nbytes(meta_bytes: int, tensors: Iterable[tuple[str, int, int]]) -> int:
    """Size of a GGUF file holding metadata of `meta_bytes` (kv_nbytes, plus the
    architecture) and `tensors` as (name, number of dimensions, data bytes): the header,
    each tensor's info, and the data, each tensor padded to ALIGNMENT."""
    pad = lambda n: -(-n // ALIGNMENT) * ALIGNMENT          # noqa: E731
    tensors = list(tensors)
    infos = sum(8 + len(name) + 4 + 8 * ndim + 4 + 8 for name, ndim, _ in tensors)
    return pad(24 + 64 + meta_bytes + infos) + sum(pad(n) for _, _, n in tensors)


def check_written(tmp: Path, size: int) -> None:
    """An OSError unless `tmp` holds all `size` bytes written to it. numpy's tofile (the gguf
    writer's tensor data) can lose the end of its buffered bytes on a full disk without an
    error: the file comes out short, and would otherwise be renamed over the good one."""
    got = tmp.stat().st_size
    if got == size:
        return
    if shutil.disk_usage(tmp.parent).free < size - got + (1 << 16):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise OSError(errno.EIO, f"the file came out {size - got} bytes short of its {size}")


def write_gguf(path: str | os.PathLike, arch: str, kvs: Iterable[KV], tensors: Iterable[TensorOut]) -> None:
    """Write a GGUF file atomically. `general.architecture` comes from `arch`; any
    `general.architecture` in `kvs` is ignored. Tensors are streamed one by one."""
    tensors = list(tensors)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        for item in kvs:
            if item.key == "general.architecture":
                continue
            if item.key == "general.alignment":        # must also change where the writer pads
                w.add_custom_alignment(int(item.value))
                continue
            w.add_key_value(item.key, item.value, item.vtype, item.sub_type)
        for t in tensors:
            block, _ = gguf.GGML_QUANT_SIZES[t.qtype]
            if t.shape[-1] % block:
                raise GGUFError(f"{path}: tensor '{t.name}' has {t.shape[-1]} columns, not a multiple of "
                                f"the {t.qtype.name} block size {block}")
            # numpy-order element shape; add_tensor_info reverses it into ggml ne
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.fout[0].flush()
        size = w.fout[0].tell()
        if tensors:                                   # each tensor starts and ends aligned
            size = sum((w.ggml_pad(t.nbytes, w.data_alignment) for t in tensors), w.ggml_pad(size, w.data_alignment))
        for t in tensors:
            data = np.ascontiguousarray(t.make())
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor '{t.name}': {data.nbytes} bytes produced, {t.nbytes} expected")
            w.write_tensor_data(data)
        w.close()
        check_written(tmp, size)
