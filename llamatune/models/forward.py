"""The forward pass of the llama-family blocks, once, for inference and for training.

Mirrors llama.cpp's per-architecture graph builders (src/models/llama.cpp, qwen2,
qwen3, gemma, gemma2, gemma3, phi3), read from the architecture's declaration
(models/arch.py) and its config. A layer is a mixer and a feed-forward part, each
owning its norms and linears (models/parts.py; the declaration names their kinds).
Per layer of the llama-like parts, with xn = RMSNorm(x), the declaration's options in
brackets:
    q, k, v = xn Wq^T, xn Wk^T, xn Wv^T      [qk_norm: q, k = RMSNorm per head (qp, kp before)]
    q, k    = rope(q), rope(k)               (the layer's rope: gemma3's local layers differ)
    o       = attn(q, k, v) Wo^T             (the layer's scale, soft-cap and sliding window)
    x_mid   = x + o                          [post_norms: x + RMSNorm(o, post_attention_norm)]
    g, u    = n2 Wg^T, n2 Wu^T               n2 = RMSNorm(x_mid)
    f       = (act(g) * u) Wd^T              act = silu (SwiGLU) or gelu (GeGLU)
    x_out   = x_mid + f                      [post_norms: x_mid + RMSNorm(f, post_ffw_norm)]
The embedding may be scaled (gemma: sqrt(n_embd)). q/k/v and gate/up come from one
fused matmul split by rows where the architecture declares it (phi3's attn_qkv,
ffn_up), one LoRA pair on the whole product as llama.cpp's build_lora_mm applies it.

`Forward` runs the blocks (the parts call back into it for every linear, norm weight,
scratch buffer and kernel); its users differ only in what they hand it:
  - `infer.Runner` (perplexity, generate, chat): activations of one call, a KV cache
    (`kv` appends the step's keys and values and attends over the cache), runtime
    adapters (llama.cpp's --lora), the full logits;
  - `train.step.StepExecutor`: activations it keeps for backward (per layer, or shared in
    checkpointing mode `layer`), trainable adapters (dropout, the x A^T it keeps, the
    merge into a dequantized matrix), the loss head and the backward.
Every product with a base weight goes through `base_product`: the one place where its
precision is chosen. The elementwise chains that run back to back (the per-head norms
then rope, rope of q and k, the residual add then the next norm) go through
`ops.fused`: one launch each on a GPU, the separate kernels (the same bits) on the CPU.
"""
from __future__ import annotations

import numpy as np

from ..backend import Backend
from ..precision import F32, ComputePolicy
from .config import ModelConfig
from .parts import LayerActs, Part, layer_parts
from .products import make_products

OUTPUT_SCALE = "layer_output_scale.weight"
PLE_TABLE, PLE_PROJ, PLE_NORM = ("per_layer_token_embd.weight", "per_layer_model_proj.weight",
                                 "per_layer_proj_norm.weight")     # gemma4's per-layer embeddings


class Linears:
    """How the linears of a Forward compute beyond their base product, by weight name:
    inference's runtime adapters (llama.cpp's --lora: y += s (x A^T) B^T after the
    product, several per weight), none by default. Training's strategy (LoRA in
    factored form, merged into a dequantized copy, riding in a bf16 product, merge-aware,
    dense trained weights) is train.linear.LoraLinears, the same methods."""

    def __init__(self, fw: "Forward", adapters: dict[str, list] | None = None):
        self.fw, self.adapters = fw, adapters or {}

    def pairs(self, name: str) -> list:
        """[(A, B, scale)] applied to base weight `name` (token_embd: A (V, r), B (C, r))."""
        return self.adapters.get(name, ())

    def scratch(self, rows: int, cols: int) -> np.ndarray:
        """A (rows, cols) buffer for a product about to be added somewhere."""
        return self.fw.xp.empty((rows, cols), np.float32)

    def norm_weight(self, name: str) -> np.ndarray:
        """A norm weight as the forward uses it."""
        return self.fw.weights.vector(name)

    def matrix(self, name: str, N: int) -> tuple[np.ndarray, bool]:
        """The matrix W (n_out, n_in) of a linear over N tokens, and whether the adapters'
        share is already in it (training may merge B A into a dequantized copy)."""
        return self.fw.weight(name, N), False

    def add_adapters(self, y: np.ndarray, x: np.ndarray, name: str, merged: bool) -> None:
        """y += sum_i s_i (x A_i^T) B_i^T."""
        for a, b, s in self.pairs(name):
            self.fw.lora_ops.lora_forward(y, x @ a.T, b, s, self.scratch(*y.shape))

    def in_product(self, name: str, N: int) -> bool:
        """Whether the adapter of `name` rides in the base product's K axis (`adapted_forward`):
        training's choice with bf16 products; inference adds its adapters after."""
        return False

    def adapted_forward(self, y: np.ndarray, x: np.ndarray, name: str) -> None:
        raise NotImplementedError("only training carries adapters in the products")

    def shared_extension(self, names: list[str], N: int) -> int:
        """Columns the shared bf16 input of `names` needs for adapters in the products."""
        return 0


class Forward:
    """The block forward over a weight provider (weights.FrozenBase or params.DenseWeights).

    A user sets, before a layer runs: `ropes` ((cos, sin) per rope set of the config),
    `segments` (packed rows or None), `xn` (N, C) and `h` (N, F) scratch (used where the
    layer's LayerActs keeps no xn1/xn2/h), `fused` (a flat buffer of N * fused_width
    floats, with fused projections)."""
    segments = None

    def __init__(self, cfg: ModelConfig, weights, backend: Backend, policy: ComputePolicy = F32,
                 parts: dict[str, type[Part]] | None = None):
        """`parts`: kind -> class of the layers' parts (models/parts.PARTS by default). A
        user with adapters sets `linears` (Linears: inference's runtime adapters; training's
        train.linear.LoraLinears)."""
        self.cfg, self.weights, self.backend, self.policy = cfg, weights, backend, policy
        self.layer_parts = layer_parts(cfg, parts)          # (mixer, feed-forward) per layer
        # gemma4: each layer's output times its blk.N.layer_output_scale (1,), a frozen vector
        self.output_scales = [f"blk.{i}.{OUTPUT_SCALE}" if OUTPUT_SCALE in cfg.spec.vectors else None
                              for i in range(cfg.n_layer)]
        self.xp, self.ops = backend.xp, backend.ops
        self.products = make_products(backend, policy)    # every product with a base weight
        self.lora_ops = policy.lora(self.ops.lora)        # the adapters' rank-r products
        self.attention = policy.attention(self.ops.attention)   # attention's kernels
        self.observer = None      # optional observer(name, x): every base matmul's input (calibration.py)
        self.recomputing = False  # a training step's recompute of a layer whose output nobody reads
        self.linears = Linears(self)                      # what each linear adds to its base product
        self.kept_kv: dict[int, tuple] = {}               # layer -> (k, v, n_past) it made for the layers
        #                                                   sharing them (gemma4's shared KV)
        self.ple: dict[str, np.ndarray] = {}              # per-layer embeddings' buffers (ple_buffers)

    # ------------------------------------------------------------------ what a user supplies
    def weight(self, name: str, N: int) -> np.ndarray:
        """A base matrix as the products over N tokens take it: float32, or with bf16
        products (N at least the policy's bf16_min_rows) dequantized straight to bf16 (half
        the bytes; products.py)."""
        if self.products.bf16_for(N):
            return self.weights.matrix_rows_bf16(name)
        return self.weights.matrix(name)

    def weight_rows(self, name: str, lo: int, hi: int, N: int) -> np.ndarray:
        """Rows lo:hi of a base matrix (the output head's blocks), as `weight`."""
        if self.products.bf16_for(N):
            return self.weights.matrix_rows_bf16(name, lo, hi)
        return self.weights.matrix_rows(name, lo, hi)

    def gate_scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two (N, F) float32 buffers for the gate's inputs where the layer keeps them as
        bf16 bits (training with bf16 products: train.step.StepExecutor)."""
        raise NotImplementedError("only a training graph keeps g and u as bf16")

    def expert_buffers(self, i: int) -> dict:
        """Layer i's planned mixture-of-experts buffers (kernels/moe.py SCRATCH, its
        adapters' "xa.<projection>"): a training graph's (train/buffers.py); none here,
        the experts' kernels allocate them."""
        return {}

    def kv(self, i: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The keys and values layer i attends over, and the position of k's first row:
        the step's own (training); inference appends them to its cache."""
        return k, v, 0

    def ple_buffers(self, N: int) -> dict[str, np.ndarray]:
        """The per-layer embeddings' buffers for N tokens (gemma4): "inputs" (L, N, P) the
        layers' inputs, "proj" (N, L P) the projection before its norm, "rstd" (N L,) its
        norm's, "d" (L, N, P) scratch (training: the inputs' gradient). Made here for one
        call; a training graph hands out its planned ones."""
        L, P = self.cfg.n_layer, self.cfg.n_embd_per_layer
        shapes = {"inputs": (L, N, P), "proj": (N, L * P), "rstd": (N * L,), "d": (L, N, P)}
        return {k: self.xp.empty(s, np.float32) for k, s in shapes.items()}

    def enter_layer(self, i: int) -> None:
        """Before layer i runs (forward or backward): where layers differ in width (gemma4),
        a user views its shared scratch at layer i's widths; nothing by default."""

    def recurrent_state(self, i: int):
        """Layer i's delta-net decoding state (models/deltanet_mixer.RecurrentState) to
        continue, or None: the step's rows start from zero state (training, no cache)."""
        return None

    # ------------------------------------------------------------------ building blocks
    def base_product(self, y: np.ndarray, x: np.ndarray, W: np.ndarray) -> None:
        """y (N, n_out) = x (N, n_in) W^T, in the compute dtype (products.py)."""
        self.products(y, x, W, trans_b=True)

    def head_logits(self, logits: np.ndarray, x: np.ndarray, blocks: list, rows, adapters: list,
                    scratch=None) -> None:
        """logits (n, V) = x W_out^T + sum of the adapters' (s x A^T) B^T, one block of the head's
        rows at a time: the one head forward of inference (infer.Runner.head) and training
        (train/head.py, its loss and gradient on top). rows(block): the block's rows as a weight
        (expanded); adapters: [(s x A^T (n, r), B (V, r))]; scratch(n, m): where an adapter's
        (n, m) share is made (None: a new array)."""
        with self.products.shared_input(x):              # x rounded to bf16 once, not once a block
            for lo, hi in blocks:
                self.base_product(logits[:, lo:hi], x, rows((lo, hi)))
                for sxa, b in adapters:
                    out = None if scratch is None else scratch(x.shape[0], hi - lo)
                    logits[:, lo:hi] += self.xp.matmul(sxa, b[lo:hi].T, out=out)

    def linear(self, y: np.ndarray, x: np.ndarray, name: str) -> np.ndarray:
        """y (N, n_out) = x W^T (+ bias) + the adapters' share (in the base product where
        `Linears.in_product`: products.Products.adapted)."""
        if self.observer is not None:
            self.observer(name, x)
        linears = self.linears
        carried = linears.in_product(name, x.shape[0])
        if carried:
            linears.adapted_forward(y, x, name)
        else:
            W, merged = linears.matrix(name, x.shape[0])
            self.base_product(y, x, W)
        bias = self.weights.vector(name.replace(".weight", ".bias"))
        if bias is not None:
            y += bias
        if not carried:
            linears.add_adapters(y, x, name, merged)
        return y

    def stores_bf16(self, names: list[str], N: int) -> bool:
        """Whether the linears `names` over N tokens may store their results as bf16 bits
        straight from the product (kernels/bf16.gemm into uint16: the float32 result
        rounded as it is stored): bf16 products, no bias, and no adapter share to add
        after the product (the caller's matrices are separate, not one fused product)."""
        return (self.products.bf16_for(N)
                and all(self.weights.vector(n.replace(".weight", ".bias")) is None
                        and (not self.linears.pairs(n) or self.linears.in_product(n, N)) for n in names))

    def fused_rows(self, width: int) -> np.ndarray:
        N = self.xn.shape[0]
        return self.fused[: N * width].reshape(N, width)

    def embd_scale(self):
        """The embedding scale (ModelConfig.embedding_scale: gemma's sqrtf(n_embd) in f32,
        granite's embedding_scale), or None where the family has none."""
        scale = self.cfg.embedding_scale
        return None if scale == 1.0 else self.xn.dtype.type(scale)

    # ------------------------------------------------------------------ the forward
    def embed(self, tokens: np.ndarray, x: np.ndarray) -> None:
        """x (N, C) = rows of token_embd for tokens (N,) on the device (+ adapters, scale)."""
        self.weights.embed(tokens, x)
        for a, b, s in self.linears.pairs("token_embd.weight"):
            x += self.xp.matmul(s * a[tokens], b.T, out=self.linears.scratch(*x.shape))
        if self.embd_scale() is not None:
            x *= self.embd_scale()
        if self.cfg.n_embd_per_layer:
            self.per_layer_embed(tokens, x)

    def per_layer_embed(self, tokens: np.ndarray, x0: np.ndarray) -> None:
        """gemma4's per-layer inputs of the tokens into self.ple["inputs"] (L, N, P), as
        llama.cpp's build_inp_per_layer and project_per_layer_inputs (f32 constants as its):
            e = (RMSNorm((x0 W^T / sqrt(C)) per layer, per_layer_proj_norm)
                 + per_layer_token_embd[tokens] sqrt(P)) / sqrt(2)
        x0 (N, C): the scaled token embeddings; W = per_layer_model_proj (L P, C)."""
        cfg, N = self.cfg, x0.shape[0]
        L, P, dt = cfg.n_layer, cfg.n_embd_per_layer, x0.dtype.type
        self.ple = b = self.ple_buffers(N)
        proj = self.linear(b["proj"], x0, PLE_PROJ)
        proj *= dt(np.float32(1) / np.sqrt(np.float32(cfg.n_embd)))
        normed = b["inputs"].reshape(N * L, P)                 # (its memory, until the last line)
        self.ops.rmsnorm.rmsnorm_forward(normed, b["rstd"], proj.reshape(N * L, P),
                                         self.linears.norm_weight(PLE_NORM), cfg.norm_eps)
        tok = b["d"].reshape(N, L * P)
        self.weights.embed(tokens, tok, PLE_TABLE)
        tok *= dt(np.sqrt(np.float32(P)))
        tok += normed.reshape(N, L * P)
        tok *= dt(np.float32(1) / np.sqrt(np.float32(2)))
        b["inputs"][...] = tok.reshape(N, L, P).transpose(1, 0, 2)

    def per_layer_input(self, i: int) -> np.ndarray:
        """Layer i's per-layer input (N, P) (per_layer_embed)."""
        return self.ple["inputs"][i]

    def layer_forward(self, i: int, a: LayerActs, x_out: np.ndarray) -> None:
        """x_out = layer i of a.x, filling the rest of `a`: its mixer, then its feed-forward
        (models/parts.py), then a third part where it has one (gemma4's per-layer input),
        each adding its output to the residual stream."""
        self.enter_layer(i)
        mixer, ffn, *post = self.layer_parts[i]
        mixer.forward(self, a.mixer, a.x, None, a.x_mid)      # x_mid = mixer(x)
        if post:
            ffn.forward(self, a.ffn, a.x_mid, a.x, a.x_post)  # x_mid += x; x_post = ffn(x_mid)
            a.x_post += a.x_mid
            post[0].forward(self, a.post, a.x_post, None, x_out)
            x_out += a.x_post
        else:
            ffn.forward(self, a.ffn, a.x_mid, a.x, x_out)    # x_mid += x; x_out = ffn(x_mid)
            x_out += a.x_mid
        if self.output_scales[i] is not None:
            x_out *= self.output_scale(i, x_out.dtype)

    def output_scale(self, i: int, dtype):
        """Layer i's output scale (gemma4's layer_output_scale) as a scalar of `dtype`."""
        return dtype.type(float(self.weights.vector(self.output_scales[i])[0]))
