"""Model hyperparameters: one frozen dataclass, built only from GGUF metadata.

Mirrors llama.cpp's llm_load_hparams: the keys every llama-family model has are read
here; what an architecture adds is read by its declaration (models/archs/<arch>.py,
`Arch.read_hparams`). Derived values are properties; `__post_init__` validates.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import LlamatuneError
from ..formats.gguf_io import check_float, check_int, describe
from .arch import Arch, check_dense, get_arch

MAX_COUNT = 2**31 - 1      # llama.cpp holds hyperparameters as int32

def _rope_scaling(md: dict, arch: str, number, source: str) -> tuple[float, bool]:
    """(the rope scaling factor, whether it is YaRN) from the metadata: linear or yarn
    (llama.cpp applies YaRN to any family); absent or 0: no scaling."""
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    if not isinstance(scaling_type, str):
        raise LlamatuneError(f"{source}: metadata key '{arch}.rope.scaling.type' is {describe(scaling_type)}, "
                             "expected a string")
    factor_key = "rope.scaling.factor" if f"{arch}.rope.scaling.factor" in md else "rope.scale_linear"
    factor = number(factor_key) if md.get(f"{arch}.{factor_key}") else 1.0
    if scaling_type not in ("none", "linear", "yarn") and factor != 1.0:
        raise LlamatuneError(f"{source}: rope scaling type '{scaling_type}' is not supported (only linear "
                             "and yarn)")
    return factor, scaling_type == "yarn" and factor != 1.0


def _tokens_count(md: dict[str, Any], arch: str, source: str) -> int:
    """The vocabulary size of a model without `{arch}.vocab_size`: its tokenizer's tokens."""
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise LlamatuneError(f"{source}: cannot tell the vocabulary size "
                             f"(no '{arch}.vocab_size' and no 'tokenizer.ggml.tokens')")
    if not isinstance(tokens, list) or not tokens:
        raise LlamatuneError(f"{source}: metadata key 'tokenizer.ggml.tokens' is {describe(tokens)}, "
                             "expected a non-empty list of strings")
    return len(tokens)


def _architecture(md: dict[str, Any], source: str):
    """The file's `general.architecture` and its declared family (ArchSpec); a family we do
    not know, or a mixture of experts of a family that has none, is refused naming `source`."""
    arch = md.get("general.architecture")
    if arch is None:
        raise LlamatuneError(f"{source}: missing required metadata key 'general.architecture'")
    if not isinstance(arch, str):
        raise LlamatuneError(f"{source}: metadata key 'general.architecture' is {describe(arch)}, "
                             "expected a string")
    n_experts = check_int(md.get(f"{arch}.expert_count", 0), 0, MAX_COUNT, f"{source}: metadata key '{arch}.expert_count'")
    try:
        check_dense(arch, n_experts)
        return arch, get_arch(arch)
    except LlamatuneError as e:
        raise LlamatuneError(f"{source}: {e}") from None


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_ctx_train: int          # context length the model was trained with
    n_embd: int               # C
    n_layer: int              # L
    n_ff: int                 # F, SwiGLU hidden size
    n_head: int               # NH
    n_head_kv: int            # NKV (GQA: NH % NKV == 0)
    head_dim: int             # HS
    n_rot: int                # rotary dimensions per head (<= HS)
    norm_eps: float
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0   # 1/linear scaling factor, as llama.cpp stores it in cparams
    n_ctx_orig: int = 0            # rope.scaling.original_context_length (0: n_ctx_train): contexts above it
    #                                rotate with rope_factors_long, the others with rope_factors_short
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: cos and sin are multiplied by it (ggml_rope_ext)
    rope_ext_factor: float = 0.0   # YaRN's extrapolation mix (rope.scaling.type yarn: 1, as llama_context sets
    #                                it); 0: no YaRN. Its ramp counts from n_ctx_orig (models/rope.py)
    # what some families add (read by their Arch.read_hparams); the defaults are llama's
    attn_scale: float = 0.0        # q.k multiplier; 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0      # attention scores cap*tanh(s/cap) (gemma2); 0: none
    final_softcap: float = 0.0     # logits cap*tanh(z/cap) (gemma2); 0: none
    sliding_window: int = 0        # window of the sliding-window layers; 0: every layer attends to all
    swa_pattern: int = 0           # llama.cpp set_swa_pattern(n): layer i slides iff i % n < n - 1 (0: all)
    rope_freq_base_swa: float = 0.0    # rope base of the sliding-window layers; 0: rope_freq_base
    rope_freq_scale_swa: float = 0.0   # their linear scale; 0: rope_freq_scale
    nope_step: int = 0             # llama.cpp n_no_rope_layer_step: layer i has no rope where (i + 1) % nope_step
    #                                == 0 (smollm3: 4; granite without rope: 1); 0: rope on every layer
    embd_multiplier: float = 0.0   # token embeddings times this (granite's embedding_scale); 0: none
    residual_scale: float = 0.0    # attention and feed-forward outputs times this before their residual adds
    #                                (granite); 0: none
    logit_scale: float = 0.0       # logits divided by this (granite's logit_scale); 0: none
    # mixture of experts (an Arch with `experts`; 0 in dense models)
    n_expert: int = 0              # E: experts per layer ({arch}.expert_count)
    n_expert_used: int = 0         # k: experts each token uses ({arch}.expert_used_count)
    n_ff_exp: int = 0              # an expert's SwiGLU hidden size ({arch}.expert_feed_forward_length)
    # gated delta-net layers (qwen35: llama.cpp's ssm_* hyperparameters); 0 / (): none
    ssm_conv_kernel: int = 0       # ssm.conv_kernel: taps of the causal convolution
    ssm_state_size: int = 0        # ssm.state_size: q/k (and value) head size
    ssm_group_count: int = 0       # ssm.group_count: q/k heads
    ssm_time_step_rank: int = 0    # ssm.time_step_rank: value heads
    ssm_inner_size: int = 0        # ssm.inner_size: value heads x value head size
    recurrent_layers: tuple[bool, ...] = ()   # per layer: a delta-net layer (else attention)
    full_attention_interval: int = 0          # attention.recurrent_layers absent: every n-th layer attends
    rope_sections: tuple[int, ...] = ()       # rope.dimension_sections (multi-rope; text: all one position)
    # per-layer shapes (gemma4; llama.cpp's per-layer hparams arrays): the model-level head_dim,
    # n_rot, n_head_kv and n_ff above are then the widest layer's (what shared buffers are sized by)
    head_dim_swa: int = 0          # attention.key_length_swa: head size of the sliding-window layers (0: head_dim)
    n_rot_swa: int = 0             # rope.dimension_count_swa: their rotated dimensions (0: n_rot)
    n_head_kv_layers: tuple[int, ...] = ()    # attention.head_count_kv per layer (): n_head_kv everywhere
    n_ff_layers: tuple[int, ...] = ()         # feed_forward_length per layer (): n_ff everywhere
    n_kv_shared: int = 0           # attention.shared_kv_layers: the last layers reuse an earlier layer's K/V
    n_embd_per_layer: int = 0      # embedding_length_per_layer_input: per-layer embeddings' width (0: none)
    k_eq_v: bool = False           # attention_k_eq_v (gemma4 31B): the full-attention layers' values are their
    #                                keys' projection (no attn_v; told by the tensors, not the metadata)

    def __post_init__(self):
        # llama.cpp holds these as float32: round them the same way, once
        for name in ("norm_eps", "rope_freq_base", "rope_freq_scale", "rope_attn_factor", "rope_ext_factor", "attn_scale",
                     "attn_softcap", "final_softcap", "rope_freq_base_swa", "rope_freq_scale_swa",
                     "embd_multiplier", "residual_scale", "logit_scale"):
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))
        get_arch(self.arch)
        for name in ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "n_rot"):
            if getattr(self, name) <= 0:
                raise LlamatuneError(f"model hyperparameter {name} = {getattr(self, name)} must be positive")
        if self.n_head % self.n_head_kv:
            raise LlamatuneError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise LlamatuneError(f"rope dimension count {self.n_rot} must be even and at most the head size {self.head_dim}")
        for name in ("norm_eps", "rope_freq_base", "rope_freq_scale", "rope_attn_factor"):
            value = getattr(self, name)
            if not (value > 0 and np.isfinite(value)):       # after float32 rounding: 1e-50 -> 0, 1e300 -> inf
                raise LlamatuneError(f"model hyperparameter {name} = {value} must be positive and finite as a float32")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "rope_freq_base_swa", "rope_freq_scale_swa",
                     "embd_multiplier", "residual_scale", "logit_scale"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise LlamatuneError(f"model hyperparameter {name} = {value} must be >= 0 and finite as a float32")
        if self.recurrent_layers and len(self.recurrent_layers) != self.n_layer:
            raise LlamatuneError(f"recurrent_layers has {len(self.recurrent_layers)} entries, expected block_count "
                                 f"{self.n_layer}")
        for name in ("sliding_window", "swa_pattern", "nope_step", "ssm_conv_kernel", "ssm_state_size", "ssm_group_count",
                     "ssm_time_step_rank", "ssm_inner_size", "full_attention_interval"):
            if not 0 <= getattr(self, name) <= MAX_COUNT:
                raise LlamatuneError(f"model hyperparameter {name} = {getattr(self, name)} must be >= 0")
        self._check_experts()
        self._check_layers()

    def _check_layers(self) -> None:
        for name in ("n_head_kv_layers", "n_ff_layers"):
            values = getattr(self, name)
            if values and (len(values) != self.n_layer or min(values) <= 0):
                raise LlamatuneError(f"model hyperparameter {name} must hold {self.n_layer} positive counts, "
                                     f"got {list(values)}")
        if self.n_head_kv_layers and any(self.n_head % n for n in self.n_head_kv_layers):
            raise LlamatuneError(f"head_count {self.n_head} is not a multiple of every layer's head_count_kv "
                                 f"{list(self.n_head_kv_layers)}")
        if not 0 <= self.head_dim_swa <= self.head_dim or self.n_rot_swa > (self.head_dim_swa or self.head_dim) \
                or self.n_rot_swa % 2 or self.n_rot_swa < 0:
            raise LlamatuneError(f"sliding-window heads of {self.head_dim_swa} rotating {self.n_rot_swa}: the head "
                                 f"size must be at most the full-attention one ({self.head_dim}) and the rotated "
                                 "dimensions even and at most it")
        if not 0 <= self.n_kv_shared < self.n_layer or self.n_embd_per_layer < 0:
            raise LlamatuneError(f"shared_kv_layers {self.n_kv_shared} must be below block_count {self.n_layer}, "
                                 f"embedding_length_per_layer_input {self.n_embd_per_layer} at least 0")
        for i in range(self.n_layer - self.n_kv_shared, self.n_layer):
            self.kv_source(i)

    def _check_experts(self) -> None:
        if not self.spec.moe:
            if self.n_expert or self.n_expert_used or self.n_ff_exp:
                raise LlamatuneError(f"architecture {self.arch} has no experts: n_expert, n_expert_used and "
                                     "n_ff_exp must be 0")
            return
        if not 0 < self.n_expert_used <= self.n_expert or self.n_ff_exp <= 0:
            raise LlamatuneError(f"mixture of experts: expert_count {self.n_expert}, expert_used_count "
                                 f"{self.n_expert_used} and expert_feed_forward_length {self.n_ff_exp} must be "
                                 "positive, with expert_used_count at most expert_count")

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_head_kv

    # ---- per layer: sliding window, rope and attention options (llama.cpp hparams.is_swa(il))
    def is_swa(self, i: int) -> bool:
        """Layer i attends through the sliding window (llama.cpp set_swa_pattern(swa_pattern))."""
        n = self.swa_pattern
        return self.sliding_window > 0 and (n == 0 or i % n < n - 1)

    def is_recurrent(self, i: int) -> bool:
        """Layer i is a gated delta-net layer (qwen35), not attention."""
        return bool(self.recurrent_layers) and self.recurrent_layers[i]

    # ---- per-layer shapes (gemma4)
    @property
    def varies(self) -> bool:
        """Layers differ in head size, kv heads or feed-forward width (`layer` gives each's)."""
        return bool(self.head_dim_swa or self.n_rot_swa or self.n_head_kv_layers or self.n_ff_layers)

    def layer(self, i: int) -> "ModelConfig":
        """Layer i's config: the model's with layer i's head_dim, n_rot, n_head_kv and n_ff
        (itself where no layer differs). Its per-layer fields are the model's: rope sets
        and windows are asked of the model's config by layer index."""
        return self if not self.varies else _layer_config(self, i)

    def has_kv(self, i: int) -> bool:
        """Layer i computes keys and values (llama.cpp hparams.has_kv): not one of the last
        n_kv_shared layers, which reuse an earlier layer's."""
        return i < self.n_layer - self.n_kv_shared

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends over: i itself, or for a shared
        layer the last layer of its kind (sliding or not) that has its own (HF's
        kv_sharing_modes; llama.cpp's reuse callback picks the same in the released models)."""
        if self.has_kv(i):
            return i
        for j in reversed(range(self.n_layer - self.n_kv_shared)):
            if self.is_swa(j) == self.is_swa(i):
                return j
        raise LlamatuneError(f"layer {i} shares keys and values, but no earlier layer of its kind has its own")

    def has_v(self, i: int) -> bool:
        """Layer i projects values of its own (not the keys' projection: k_eq_v's full-attention layers)."""
        return not (self.k_eq_v and not self.is_swa(i))

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """The layers whose keys and values shared layers reuse."""
        return tuple(sorted({self.kv_source(i) for i in range(self.n_layer) if not self.has_kv(i)}))

    def window(self, i: int) -> int:
        """Attention window of layer i (0: all earlier positions)."""
        return self.sliding_window if self.is_swa(i) else 0

    def has_rope(self, i: int) -> bool:
        """Layer i rotates q and k (llama.cpp hparams.has_rope / smollm3's use_rope)."""
        return not (self.nope_step and (i + 1) % self.nope_step == 0)

    @property
    def embedding_scale(self) -> float:
        """What the token embeddings are multiplied by: gemma's sqrtf(n_embd) (f32, as llama.cpp's
        ggml_scale), granite's embedding_scale, else 1."""
        if self.spec.embd_scale:
            return float(np.sqrt(np.float32(self.n_embd)))
        return self.embd_multiplier or 1.0

    def logit_multiplier(self, dtype):
        """What the logits are multiplied by, in `dtype`: 1 / logit_scale as llama.cpp's granite
        graph computes it (ggml_scale by 1.0f / f_logit_scale, a float32); None without a logit scale."""
        if not self.logit_scale:
            return None
        return np.dtype(dtype).type(np.float32(1.0) / np.float32(self.logit_scale))

    def rope_params(self, i: int) -> tuple:
        """(freq_base, freq_scale) of layer i: the sliding-window layers' own when the model has them;
        with n_rot per layer (n_rot_swa) also its rotated dimensions, (freq_base, freq_scale, n_rot)."""
        if self.is_swa(i):
            rope = (self.rope_freq_base_swa or self.rope_freq_base, self.rope_freq_scale_swa or self.rope_freq_scale)
        else:
            rope = self.rope_freq_base, self.rope_freq_scale
        return rope + ((self.rope_rot_of(i),) if self.n_rot_swa else ())

    def rope_rot_of(self, i: int) -> int:
        """Layer i's rotated dimensions."""
        return self.n_rot_swa if self.n_rot_swa and self.is_swa(i) else self.n_rot

    def rope_rot(self, rope: tuple) -> int:
        """The rotated dimensions of a rope set (one of rope_sets)."""
        return rope[2] if len(rope) > 2 else self.n_rot

    @property
    def rope_sets(self) -> list[tuple[float, float]]:
        """The distinct (freq_base, freq_scale) of the layers, first use first: one rope cache each."""
        return list(dict.fromkeys(self.rope_params(i) for i in range(self.n_layer)))

    def rope_set(self, i: int) -> int:
        """Index in `rope_sets` of layer i's rope."""
        return self.rope_sets.index(self.rope_params(i))

    def attention_options(self, i: int) -> dict[str, Any]:
        """Keyword options of ops.attention for layer i: scale (None: 1/sqrt(head_dim)),
        softcap (0: none), window (0: none)."""
        return dict(scale=self.attn_scale or None, softcap=self.attn_softcap, window=self.window(i))

    def part_kinds(self, i: int) -> tuple[str, str]:
        """The kinds of layer i's (mixer, feed-forward) parts (models/parts.py)."""
        spec = self.spec
        return spec.parts(self, i) if spec.parts is not None else (spec.mixer, spec.ffn)

    @property
    def n_ctx_orig_rope(self) -> int:
        """The context length that decides between long and short rope factors."""
        return self.n_ctx_orig or self.n_ctx_train

    @property
    def spec(self) -> Arch:
        """The architecture's declaration (models/archs/<arch>.py)."""
        return get_arch(self.arch)

    @property
    def rope_mode(self) -> int:
        return self.spec.rope_mode

    @classmethod
    def new(cls, arch: str, **values) -> "ModelConfig":
        """A config for a new model of `arch` (train-from-scratch): the family's defaults
        (Arch.defaults: gemma2's soft-caps and window, ...) overridden by `values`."""
        return cls(arch=arch, **(dict(get_arch(arch).defaults) | values))

    @classmethod
    def from_metadata(cls, md: dict[str, Any], source: str = "model", tensors=()) -> "ModelConfig":
        """Build from a GGUF metadata dict; `source` (the file name) prefixes every error;
        `tensors`: the file's tensor names, where a family tells a hyperparameter by them
        (gemma4's attention_k_eq_v: no attn_v in its full-attention layers)."""
        arch, spec = _architecture(md, source)

        def count(key: str, default: Any = None) -> int:
            """A positive integer hyperparameter `{arch}.key` (llama.cpp holds them as int32)."""
            full = f"{arch}.{key}"
            if full not in md and default is None:
                raise LlamatuneError(f"{source}: missing required metadata key '{full}'")
            return check_int(md.get(full, default), 1, MAX_COUNT, f"{source}: metadata key '{full}'")

        def number(key: str, default: Any = None) -> float:
            full = f"{arch}.{key}"
            if full not in md and default is None:
                raise LlamatuneError(f"{source}: missing required metadata key '{full}'")
            value = check_float(md.get(full, default), f"{source}: metadata key '{full}'")
            if value <= 0:
                raise LlamatuneError(f"{source}: metadata key '{full}' is {value}, expected a positive number")
            return value

        # the family's own keys first: it may refuse what it cannot run (per-layer arrays, ...)
        # before the common keys are read, and give n_ff (qwen35moe: its shared expert's),
        # n_head_kv (gemma4) or n_layer (qwen35: block_count less its MTP layers)
        own = {} if spec.read_hparams is None else spec.read_hparams(SimpleNamespace(
            count=count, number=number, source=source, arch=arch, tensors=frozenset(tensors),
            raw=lambda key, default=None: md.get(f"{arch}.{key}", default)))
        n_embd = count("embedding_length")
        n_head = count("attention.head_count")
        n_head_kv = own["n_head_kv"] if "n_head_kv" in own else count("attention.head_count_kv", n_head)
        if f"{arch}.attention.key_length" not in md and n_embd % n_head:
            raise LlamatuneError(f"{source}: embedding_length {n_embd} is not a multiple of head_count {n_head} "
                                 f"(and there is no '{arch}.attention.key_length')")
        head_dim = count("attention.key_length", n_embd // n_head)
        n_vocab = count("vocab_size") if f"{arch}.vocab_size" in md else _tokens_count(md, arch, source)
        factor, yarn = _rope_scaling(md, arch, number, source)
        n_ff = own["n_ff"] if "n_ff" in own else count("feed_forward_length")
        values = dict(arch=arch, n_vocab=n_vocab, n_ctx_train=count("context_length"), n_embd=n_embd,
                      n_layer=own["n_layer"] if "n_layer" in own else count("block_count"), n_ff=n_ff, n_head=n_head,
                      n_head_kv=n_head_kv, head_dim=head_dim, n_rot=count("rope.dimension_count", head_dim),
                      norm_eps=number("attention.layer_norm_rms_epsilon"),
                      rope_freq_base=number("rope.freq_base", 10000.0), rope_freq_scale=1.0 / factor)
        if yarn:
            values |= dict(rope_ext_factor=1.0, n_ctx_orig=count("rope.scaling.original_context_length",
                                                                 values["n_ctx_train"]))
        values |= own
        try:
            return cls(**values)
        except LlamatuneError as e:
            raise LlamatuneError(f"{source}: {e}") from None

    def metadata(self) -> dict[str, Any]:
        """The `{arch}.*` keys that describe this config (for writing models and checkpoints)."""
        a = self.arch
        md = {
            f"{a}.vocab_size": self.n_vocab,
            f"{a}.context_length": self.n_ctx_train,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.block_count": self.n_layer,
            f"{a}.feed_forward_length": self.n_ff,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.rope.dimension_count": self.n_rot,
            f"{a}.attention.layer_norm_rms_epsilon": float(self.norm_eps),
            f"{a}.rope.freq_base": float(self.rope_freq_base),
        }
        if self.rope_freq_scale != 1.0:
            md[f"{a}.rope.scaling.type"] = "yarn" if self.rope_ext_factor else "linear"
            md[f"{a}.rope.scaling.factor"] = float(1.0 / self.rope_freq_scale)
        if self.rope_ext_factor:
            md[f"{a}.rope.scaling.original_context_length"] = self.n_ctx_orig_rope
        if self.spec.hparams_metadata is not None:
            md |= self.spec.hparams_metadata(self)
        return md


@functools.cache
def _layer_config(cfg: ModelConfig, i: int) -> ModelConfig:
    """ModelConfig.layer, made once per (config, layer)."""
    swa = cfg.is_swa(i)
    return replace(cfg, head_dim=cfg.head_dim_swa if swa and cfg.head_dim_swa else cfg.head_dim,
                   n_rot=cfg.rope_rot_of(i),
                   n_head_kv=cfg.n_head_kv_layers[i] if cfg.n_head_kv_layers else cfg.n_head_kv,
                   n_ff=cfg.n_ff_layers[i] if cfg.n_ff_layers else cfg.n_ff)
