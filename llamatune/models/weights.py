"""Where the graph and the runner get their weights, on the backend's device.

  - `FrozenBase`: a GGUF model's weights, never trained (LoRA finetuning and
    inference). They stay in their stored (quantized) form; each matrix is
    dequantized into one reused f32 scratch buffer right before its matmul, the
    output head in row blocks (`matrix_rows`), the embedding row by row. On
    CUDA the quantized bytes are uploaded once and dequantized on the GPU.
  - `DenseWeights`: every weight is an f32 parameter of the ParamBuffer
    (train-from-scratch).
Both hand out (n_out, n_in) matrices or row blocks of them, norm/bias vectors and
embedding rows.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..backend import Backend, cpu
from ..errors import LlamatuneError
from .model import Model


class FrozenBase:
    trainable = False
    lazy_grads = False

    def __init__(self, model: Model, backend: Backend | None = None):
        self.model = model
        self.backend = backend or cpu()
        w = model.weights
        self.tensors = dict(w.all_matrices())
        self.experts = dict(w.all_experts())      # 3-D expert tensors (mixtures of experts)
        if self.experts and self.backend.name != "cpu":
            raise LlamatuneError(f"{model.path}: a mixture of experts ({model.config.arch}) runs on the CPU only "
                                 "so far: use --device cpu")
        vectors = {"output_norm.weight": w.output_norm} | w.model_vectors
        for i, layer in enumerate(w.layers):
            for k, v in layer.norms.items():
                vectors[f"blk.{i}.{k}.weight"] = v
            for k, b in layer.biases.items():
                vectors[f"blk.{i}.{k}.bias"] = b
            for k, v in layer.vectors.items():
                vectors[f"blk.{i}.{k}"] = v
        self.vectors = {k: self.backend.to_device(v) for k, v in vectors.items()}
        self.rope_freqs = w.rope_freqs            # host arrays: rope caches are built on the host
        self.rope_long, self.rope_short = w.rope_long, w.rope_short
        self._raw: dict[str, object] = {}         # cuda: tensor name -> device copy of the stored bytes
        self._scratch = self._scratch_bf16 = None
        self._kept_bf16: dict[str, np.ndarray] = {}   # name -> the whole matrix in bf16 (`keep_bf16`)

    def _device_raw(self, name: str):
        raw = self._raw.get(name)
        if raw is None:
            t = self.tensors[name]
            host = np.asarray(t.data).reshape(t.n_rows, t.n_cols) if t.qtype == QType.F32 else t.raw_rows()
            raw = self._raw[name] = self.backend.to_device(host)
        return raw

    @property
    def head_rows(self) -> int:
        """Rows of the output head expanded at a time (`matrix_rows`)."""
        return self.model.dequantizer.head_rows

    def matrix(self, name: str):
        """(n_out, n_in) f32 on the device, valid until the next call (layer matrices;
        the head goes through `matrix_rows`)."""
        return self.matrix_rows(name, 0, self.tensors[name].n_rows)

    def matrix_rows(self, name: str, lo: int, hi: int):
        """Rows lo:hi of a matrix, (hi - lo, n_in) f32 on the device, valid until the next call."""
        t = self.tensors[name]
        if self.backend.name == "cpu":
            return self.model.dequantizer.block(t, lo, hi)
        if t.qtype == QType.F32:
            return self._device_raw(name)[lo:hi]
        if self._scratch is None:
            self._scratch = self.backend.xp.empty(self.model.dequantizer.size, np.float32)
        out = self._scratch[: (hi - lo) * t.n_cols].reshape(hi - lo, t.n_cols)
        if t.qtype in self.backend.ops.dequant.CUDA_TYPES:
            self.backend.ops.dequant.dequantize_into(self._device_raw(name)[lo:hi], t.qtype, out)
        else:   # types without a CUDA kernel: dequantize on the host, upload
            out[...] = self.backend.to_device(self.model.dequantizer.block(t, lo, hi))
        return out

    def matrix_rows_bf16(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo:hi (all by default) of a matrix dequantized straight to bf16 bits
        (uint16, on the backend's device), valid until the next call (or rows of its
        whole bf16 copy, `keep_bf16`)."""
        t = self.tensors[name]
        hi = t.n_rows if hi is None else hi
        kept = self._kept_bf16.get(name)
        if kept is not None:
            return kept[lo:hi]
        if self.backend.name != "cpu":
            return self._device_rows_bf16(name, t, lo, hi)
        return self.model.dequantizer.block_bf16(t, lo, hi)

    def _device_rows_bf16(self, name: str, t, lo: int, hi: int):
        """Rows lo:hi of a matrix as bf16 bits in a device scratch (a GPU's bf16 products):
        dequantized straight to bf16 by the CUDA kernels, rounded from F32 data, or (types
        without a kernel) dequantized on the host and uploaded."""
        ops = self.backend.ops
        if self._scratch_bf16 is None:
            self._scratch_bf16 = self.backend.xp.empty(self.model.dequantizer.size, np.uint16)
        out = self._scratch_bf16[: (hi - lo) * t.n_cols].reshape(hi - lo, t.n_cols)
        if t.qtype == QType.F32:
            ops.bf16.to_bf16(out, self._device_raw(name)[lo:hi])
        elif t.qtype in ops.dequant.CUDA_TYPES:
            ops.dequant.dequantize_into(self._device_raw(name)[lo:hi], t.qtype, out)
        else:
            out[...] = self.backend.to_device(self.model.dequantizer.block_bf16(t, lo, hi))
        return out

    def matrix_bf16_extended(self, name: str, cols: int = 0, rows: int = 0) -> np.ndarray:
        """A whole matrix dequantized to bf16 at the top left of a (n_rows + rows,
        n_cols + cols) scratch, the rest left for an adapter's parts (Dequantizer.block_bf16)."""
        t = self.tensors[name]
        return self.model.dequantizer.block_bf16(t, 0, t.n_rows, cols, rows)

    def keep_bf16(self, name: str) -> None:
        """Keep matrix `name` dequantized to bf16 whole, once (the frozen output head,
        otherwise expanded block by block twice per chunk of tokens: train/head.py)."""
        if name in self._kept_bf16:
            return
        t, deq = self.tensors[name], self.model.dequantizer
        kept = np.empty((t.n_rows, t.n_cols), np.uint16)
        for lo in range(0, t.n_rows, deq.head_rows):
            hi = min(t.n_rows, lo + deq.head_rows)
            kept[lo:hi] = deq.block_bf16(t, lo, hi)
        self._kept_bf16[name] = kept

    def is_kept_bf16(self, name: str) -> bool:
        """Whether matrix `name` is kept dequantized to bf16 whole (`keep_bf16`)."""
        return name in self._kept_bf16

    def is_scratch(self, name: str) -> bool:
        """Whether `matrix(name)` is a dequantized copy the caller may modify (until the
        next call), not the stored F32 data itself."""
        return self.tensors[name].qtype != QType.F32

    def expert_shape(self, name: str) -> tuple[int, int, int]:
        """(E, n_out, n_in) of a 3-D expert tensor."""
        return self.experts[name].shape

    def expert_matrix(self, name: str, e: int) -> np.ndarray:
        """Expert e's (n_out, n_in) f32 matrix of a 3-D expert tensor, valid until the next
        dequantization; only that expert's rows of the stored tensor are read (the CPU)."""
        return self.model.dequantizer.expert(self.experts[name], e)

    def expert_matrix_bf16(self, name: str, e: int) -> np.ndarray:
        """expert_matrix's rows dequantized straight to bf16 bits (uint16; the bf16 products)."""
        t = self.experts[name]
        return self.model.dequantizer.block_bf16(t, e * t.shape[1], (e + 1) * t.shape[1])

    def vector(self, name: str):
        return self.vectors.get(name)

    def embed(self, ids, out, name: str = "token_embd.weight") -> None:
        """out[i] = token_embd[ids[i]] (ids on the device), dequantizing only those rows
        (`name`: another table read so, gemma4's per_layer_token_embd)."""
        t = self.tensors[name]
        if self.backend.name == "cpu":
            if out.dtype == np.float32:
                self.model.dequantizer.rows(t, ids, out)
            else:                                 # float64 gradient tests
                out[...] = self.model.dequantizer.rows(t, ids, np.empty(out.shape, np.float32))
        elif t.qtype == QType.F32:
            out[...] = self._device_raw(name)[ids]
        elif t.qtype in self.backend.ops.dequant.CUDA_TYPES:
            self.backend.ops.dequant.dequantize_rows_into(self._device_raw(name), t.qtype, ids, out)
        else:
            host = self.model.dequantizer.rows(t, self.backend.to_host(ids), np.empty(out.shape, np.float32))
            out[...] = self.backend.to_device(host)
