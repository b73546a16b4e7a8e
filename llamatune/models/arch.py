"""An architecture, declared once and read by everything that depends on it.

A model family (llama, qwen2, ...) is a variation of one transformer block. What
varies is declared in one `Arch` in `models/archs/<name>.py` (the name is
`general.architecture`), in the spirit of llama.cpp's per-architecture tables
(llm_arch / LLM_TENSOR_NAMES, src/models/<arch>.cpp) and mlx-lm's model files:

  - which tensors each layer has, by their llama.cpp names, in file order
    (`config.py` reads the hyperparameters, `model.py` maps the tensors,
    `writer.py` writes them, `train/lora.py` lists LoRA targets from them);
  - how the block computes: the kind of part each layer is built from (`mixer`,
    `ffn`, models/parts.py) and the options those parts read (rope mode, norms,
    fused projections, activation);
  - extra hyperparameters the family keeps in metadata (`read_hparams`, `hparams_metadata`).

Adding an architecture is one file in `models/archs/` (plus any kernel it needs).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import LlamatuneError

NORM, NEOX = 0, 2   # rope modes as ggml numbers them: adjacent pairs / halves rotated

LLAMA_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
               "ffn_gate", "ffn_up", "ffn_down", "ffn_norm")
QK_NORMS = ("attn_q_norm", "attn_k_norm")               # per-head RMSNorm of q and k before rope (head_dim,)
POST_NORMS = ("post_attention_norm", "post_ffw_norm")   # RMSNorm of a sublayer's output before its residual add
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")            # feed-forward gate: SwiGLU, GeGLU (gelu-tanh), or
#                                                         gpt-oss's clamped SwiGLU (its experts only)


def block_layer(biases: bool = False, qk_norm: bool = False, post_norms: bool = False) -> tuple[str, ...]:
    """The per-layer tensor kinds of a llama-like block, file order: qkv biases (qwen2),
    q/k norms (qwen3, gemma3), post-attention / post-feed-forward norms (gemma2, gemma3)."""
    qkv = ("attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias") if biases \
        else ("attn_q", "attn_k", "attn_v")
    return (("attn_norm",) + qkv + ("attn_output",) + (QK_NORMS if qk_norm else ())
            + (POST_NORMS[:1] if post_norms else ()) + ("ffn_gate", "ffn_up", "ffn_down", "ffn_norm")
            + (POST_NORMS[1:] if post_norms else ()))


@dataclass(frozen=True)
class Arch:
    name: str                         # general.architecture
    rope_mode: int                    # NORM or NEOX
    layer: tuple[str, ...] = LLAMA_LAYER   # per-layer tensors, file order: "kind" is blk.N.kind.weight,
    #                                   "kind.bias" is blk.N.kind.bias; kinds ending in "norm" are vectors
    # extra ModelConfig fields from `{arch}.*` metadata, for families that keep more
    # hyperparameters than llama: read_hparams(read) with read.count(key, default),
    # read.number(key, default) (validated, errors name the file and key) and
    # read.raw(key, default), read.source (the file, for errors) and read.arch;
    # hparams_metadata(cfg) gives the keys back for writing
    read_hparams: Callable[[Any], dict[str, Any]] | None = None
    hparams_metadata: Callable[[Any], dict[str, Any]] | None = None
    # fused projections, as llama.cpp's build_qkv / build_ffn compute them: one matmul,
    # then views of its output. A LoRA adapter on a fused tensor is one A, B pair on the
    # whole product (llama.cpp's build_lora_mm), split with it.
    fused_qkv: bool = False           # `attn_qkv` (Cq + 2 Ckv, C): rows q | k | v, instead of attn_q/k/v
    fused_gate_up: bool = False       # `ffn_up` (2F, C): rows gate | up (ggml_swiglu on one tensor), no ffn_gate
    # Hugging Face module of each layer kind, under model.layers.N. (PEFT adapter names,
    # formats/peft.py); kinds absent here have no PEFT module
    peft_modules: tuple[tuple[str, str], ...] = (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"))
    peft_permute_qk: bool = False     # convert_hf_to_gguf.py reorders q/k rows for NORM rope (llama)
    # HF's fused 3-D expert parameters (PEFT target_parameters, formats/peft_experts.py):
    # ((the GGUF expert kinds whose rows they hold, in order), the parameter under
    # model.layers.N., "stacked" | "interleaved" rows), in the HF module's parameter order
    peft_experts: tuple[tuple[tuple[str, ...], str, str], ...] = ()
    # peft_orders(cfg) -> {kind: ("rows" | "cols", p)}: kinds whose B rows or A columns the
    # converter reorders (gguf = hf[p]); cfg None (no base model): {kind: None} for each
    # kind it may reorder
    peft_orders: Callable[[Any], dict[str, Any]] | None = None
    scratch: bool = True              # train-from-scratch can build one (`--arch`)
    activation: str = "silu"          # feed-forward gate: "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    embd_scale: bool = False          # token embeddings times sqrt(n_embd) (f32), as gemma
    tied: bool = False                # the head is always token_embd (llama.cpp never reads `output`)
    qk_norm_full: bool = False        # attn_q_norm / attn_k_norm norm the whole projection (olmo2: one
    #                                   (Cq,) / (Ckv,) weight), not each head ((head_dim,), qwen3, gemma3)
    # ModelConfig values a new model of the family gets (train-from-scratch: ModelConfig.new),
    # the same numbers read_hparams falls back to, as llama.cpp's defaults for absent keys
    defaults: tuple[tuple[str, Any], ...] = ()
    # attention scale, soft-capping, sliding windows and per-layer rope come from
    # ModelConfig fields (read_hparams fills them); their defaults are llama's
    # mixture of experts (qwen3moe): the per-layer 3-D expert tensors, kept out of `layer`
    # (their adapters are per expert, 3-D, and they are dequantized one expert at a
    # time); the layer's feed-forward is then the router `ffn_gate_inp` (in `layer`) and
    # these, llama.cpp's build_moe_ffn (models/moe.py); ModelConfig's n_expert,
    # n_expert_used and n_ff_exp give their sizes
    experts: tuple[str, ...] = ()
    expert_norm: bool = True          # the top-k router weights normalized to sum 1 (build_moe_ffn's norm_w)
    # hybrid families (qwen35: delta-net and attention layers): layer_kinds(cfg, i) gives
    # layer i's kinds, file order (None: every layer has `layer`, which then lists the
    # kinds of every layer kind); shapes(cfg) the shapes of kinds of the family's own or
    # that differ from tensor_shape's; `vectors` the per-layer float32 vectors kept in
    # Layer.vectors under their full suffix ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight")
    layer_kinds: Callable[[Any, int], tuple[str, ...]] | None = None
    shapes: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    vectors: tuple[str, ...] = ()
    # the parts of each layer (models/parts.py PARTS: their kinds): the mixer and the
    # feed-forward every layer has, or parts(cfg, i) -> (mixer, ffn) per layer (hybrids),
    # or (mixer, ffn, post): a third part after the feed-forward (gemma4's per-layer input)
    mixer: str = "attention"
    ffn: str = "feed_forward"
    swa_rope_factors: bool = True     # the sliding-window layers' rope takes rope_freqs too (gemma4: only
    #                                   the full-attention layers', llama.cpp's layer.rope_freqs)
    parts: Callable[[Any, int], tuple[str, ...]] | None = None
    # model-level tensors beyond token_embd / output / output_norm: model_tensors(cfg) ->
    # {llama.cpp name: numpy shape} (gemma4's per-layer embeddings): names ending in
    # "token_embd.weight" are read row by row as token_embd, "norm.weight" are vectors,
    # the rest matrices
    model_tensors: Callable[[Any], dict[str, tuple[int, ...]]] | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"architecture {self.name}: activation {self.activation!r} is not one of {ACTIVATIONS}")

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k after their projection, before rope (qwen3, gemma3)."""
        return QK_NORMS[0] in self.layer

    @property
    def pre_norms(self) -> bool:
        """RMSNorm before attention and before the feed-forward (every family but olmo2)."""
        return "attn_norm" in self.layer

    @property
    def post_norms(self) -> bool:
        """RMSNorm on the attention and feed-forward outputs before the residual add (gemma2, gemma3)."""
        return POST_NORMS[0] in self.layer

    @property
    def moe(self) -> bool:
        """The feed-forward is a mixture of experts (`experts` declared)."""
        return bool(self.experts)

    @property
    def matrices(self) -> tuple[str, ...]:
        """Per-layer weight kinds that go through a matmul, file order."""
        return self.matrices_of(self.layer)

    @property
    def norms(self) -> tuple[str, ...]:
        """Per-layer norm weight kinds (vectors), file order."""
        return self.norms_of(self.layer)

    @property
    def biases(self) -> tuple[str, ...]:
        """Matrix kinds that also have a bias vector."""
        return self.biases_of(self.layer)

    def matrices_of(self, kinds) -> tuple[str, ...]:
        return tuple(k for k in kinds if "." not in k and not k.endswith("norm") and k not in self.vectors)

    def norms_of(self, kinds) -> tuple[str, ...]:
        return tuple(k for k in kinds if "." not in k and k.endswith("norm"))

    def biases_of(self, kinds) -> tuple[str, ...]:
        return tuple(k.removesuffix(".bias") for k in kinds if k.endswith(".bias") and k not in self.vectors)

    def kinds(self, cfg, i: int) -> tuple[str, ...]:
        """Layer i's tensor kinds, file order (hybrid families: the kind of layer i's)."""
        return self.layer if self.layer_kinds is None else self.layer_kinds(cfg, i)

    def layer_tensors(self, i: int, kinds=None) -> list[str]:
        """Full llama.cpp names of layer i's tensors (of `kinds`, default `layer`, then the
        expert tensors of a mixture of experts), file order."""
        return [f"blk.{i}.{k}" if "." in k or k in self.vectors else f"blk.{i}.{k}.weight"
                for k in (self.layer if kinds is None else kinds) + self.experts]


def tensor_shape(cfg, kind: str) -> tuple[int, ...]:
    """Numpy shape of a tensor kind ((n_out, n_in) for matrices, (n,) for vectors) in a
    model with config `cfg`. `kind` is a layer kind ("attn_q", "attn_q.bias", "attn_norm")
    or a model-level one ("token_embd", "output", "output_norm")."""
    C, F, V, Cq, Ckv = cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.n_embd_q, cfg.n_embd_kv
    own = cfg.spec.shapes(cfg) if cfg.spec.shapes is not None else {}
    if kind in own:
        return own[kind]
    if kind.endswith(".bias"):
        return (tensor_shape(cfg, kind.removesuffix(".bias"))[0],)
    shapes = {
        "attn_q": (Cq, C), "attn_k": (Ckv, C), "attn_v": (Ckv, C), "attn_output": (C, Cq),
        "ffn_gate": (F, C), "ffn_up": (2 * F if cfg.spec.fused_gate_up else F, C), "ffn_down": (C, F),
        "token_embd": (V, C), "output": (V, C),
        "attn_norm": (C,), "ffn_norm": (C,), "output_norm": (C,),
        "attn_q_norm": (cfg.head_dim,), "attn_k_norm": (cfg.head_dim,),
        "post_attention_norm": (C,), "post_ffw_norm": (C,),
    }
    if cfg.spec.qk_norm_full:
        shapes["attn_q_norm"], shapes["attn_k_norm"] = (Cq,), (Ckv,)
    if cfg.spec.fused_qkv:
        shapes["attn_qkv"] = (Cq + 2 * Ckv, C)
    if cfg.spec.moe:
        E, Fe = cfg.n_expert, cfg.n_ff_exp
        shapes |= {"ffn_gate_inp": (E, C), "ffn_gate_exps": (E, Fe, C), "ffn_up_exps": (E, Fe, C),
                   "ffn_down_exps": (E, C, Fe)}
    if kind not in shapes:
        raise KeyError(f"architecture {cfg.arch}: no shape for tensor kind '{kind}'")
    return shapes[kind]


def model_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The architecture's model-level tensors beyond token_embd / output / output_norm
    (Arch.model_tensors), name -> numpy shape."""
    return {} if cfg.spec.model_tensors is None else cfg.spec.model_tensors(cfg)


def layer_matrix_shapes(cfg) -> list[tuple[int, ...]]:
    """Shapes of the per-layer matrices of `cfg`'s architecture (buffer sizes: per-layer
    widths are the widest layer's in `cfg`), and of its model-level matrices."""
    return [tensor_shape(cfg, k) for k in cfg.spec.matrices] + [
        s for n, s in model_tensor_shapes(cfg).items() if len(s) == 2 and not n.endswith("token_embd.weight")]


def supported() -> list[str]:
    """Names of the architectures declared in models/archs/."""
    return list(_declared())


@functools.cache
def _declared() -> tuple[str, ...]:
    # listed once: `cfg.spec` looks an architecture up on every access, about a hundred
    # times a training step, and listing the package's folder each time cost 1 % of it
    from . import archs
    return tuple(sorted(_arch_name(m.name) for m in pkgutil.iter_modules(archs.__path__) if not m.name.startswith("_")))


def _arch_name(module: str) -> str:
    """general.architecture of the module models/archs/<module>.py: its name, '_' read as
    '-' (gpt_oss.py declares gpt-oss; no architecture name has an underscore)."""
    return module.replace("_", "-")


# general.architecture of llama.cpp's mixture-of-experts families (src/llama-arch.cpp, the
# openai-moe of its first gpt-oss files too); a file of any other architecture whose
# `{arch}.expert_count` is above 0 is one as well (Mixtral's architecture is `llama`)
MOE_ARCHS = frozenset({
    "afmoe", "arctic", "bailingmoe", "bailingmoe2", "bailingmoe3", "cohere2moe", "dbrx", "deepseek",
    "deepseek2", "deepseek32", "deepseek4", "dots1", "ernie4_5-moe", "exaone-moe", "glm4moe", "gpt-oss",
    "granitemoe", "grok", "grovemoe", "hunyuan-moe", "jamba", "lfm2moe", "llada-moe", "llama4",
    "minimax-m2", "nemotron_h_moe", "olmoe", "openai-moe", "phimoe", "qwen2moe", "qwen35moe",
    "qwen3moe", "qwen3next", "qwen3vlmoe", "smallthinker",
})


def moe_supported() -> list[str]:
    """The mixture-of-experts architectures declared here."""
    return [n for n in supported() if get_arch(n).moe]


def check_dense(name: str, n_experts: int) -> None:
    """Refuse a mixture-of-experts model of a family not declared with experts here (a
    family of MOE_ARCHS, or `n_experts`, the file's `{arch}.expert_count`, above 0, as
    Mixtral's `llama`), in one line naming its architecture and the supported ones."""
    if name in moe_supported() or (n_experts == 0 and name not in MOE_ARCHS):
        return
    experts = f" with {n_experts} experts" if n_experts else ""
    dense = [n for n in supported() if n not in moe_supported()]
    raise LlamatuneError(f"architecture '{name}'{experts} is a mixture of experts not supported yet "
                         f"(supported: dense models of {', '.join(dense)}; mixtures of experts of "
                         f"{', '.join(moe_supported())})")


def get_arch(name: str) -> Arch:
    """The declaration of architecture `name`; an error listing the supported ones otherwise."""
    if name not in _declared():
        raise LlamatuneError(f"architecture '{name}' is not supported (supported: {', '.join(supported())})")
    return importlib.import_module(f"{__package__}.archs.{name.replace('-', '_')}").ARCH
