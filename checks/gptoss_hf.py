"""A tiny gpt-oss made by Hugging Face transformers, its GGUF files made by llama.cpp's own
converter (F32, Q8_0) and quantizer (MXFP4_MOE), and HF's float64 logits (and autograd
gradients) on given ids: the oracle of the gpt-oss tests and checks (checks/moe_hf.py
does the same for qwen3moe and lends its runner, its commands and its PEFT gradients;
checks/hf_tiny.py the tokenizer, the training and the converter).

    python -m checks.gptoss_hf make DIR --torch-python PATH [--steps 300]
    python -m checks.gptoss_hf logits DIR IDS.npy OUT.npz --torch-python PATH

`make` writes into DIR: `hf/` (the model and its tokenizer), `gpt-oss-f32.gguf`,
`gpt-oss-q8_0.gguf` and `gpt-oss-mxfp4.gguf` (llama-quantize MXFP4_MOE of the F32 file:
experts in MXFP4, the rest Q8_0). The model: GptOssForCausalLM, 2 layers (the first
slides over a window of 16 tokens, the second attends to all), hidden 64, 4 query heads
and 2 kv heads of 16, 8 experts of 32 with 2 active, biases on q/k/v/o, on the router and
on the experts, attention sinks, YaRN rope (factor 32 over an original context of 4096,
beta 32/1, as gpt-oss-20b) with `truncate` left at HF's default (True: llama.cpp always
floors and ceils the correction range; gpt-oss-20b's config says False, a difference of
the two implementations, not of the files); trained `--steps` AdamW steps on
shakespeare.txt (ctx 64, batch 8) so that sinks, routers and experts are not random.

`logits` runs the saved model in float64 on ids (B, T) int64 and writes `logits`
(B, T, V), with HF's float32 steps (RMSNorm, the rope tables) made float64. `grads`
(`hf_lora_grads`) gives the float64 loss and the autograd gradients of LoRA pairs: on
attention through PEFT, on the experts as llama.cpp's build_lora_mm_id applies them (per
expert A (r, n_in), B (n_out, r) on the gate, up and down products, which HF keeps fused
and interleaved in gate_up_proj: HF's expert forward with those terms added).
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np

if __package__:
    from . import hf_tiny, moe_hf
else:                                          # run as a script under the torch Python
    import hf_tiny
    import moe_hf

ARCH = "gpt-oss"
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096}
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
              num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
              tie_word_embeddings=False, max_position_embeddings=131072, rope_parameters=ROPE,
              rms_norm_eps=1e-5, router_aux_loss_coef=0.0, attention_bias=True,
              bos_token_id=None, eos_token_id=0, pad_token_id=None)


# --------------------------------------------------------------------------- the torch side
def _make_hf(out: Path, steps: int) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = moe_hf.TRAIN_TEXT.read_text(encoding="utf-8")
    tok = hf_tiny.train_tokenizer(text, out, CONFIG["vocab_size"])
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG))
    with torch.no_grad():                     # norms off 1 and biases off 0 so that every weight matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif "bias" in n or n.endswith("sinks"):
                p.copy_(0.3 * torch.randn_like(p))
    hf_tiny.train(model, ids, steps, seed=None, label=ARCH)   # windows from the seeded global generator
    model.save_pretrained(out)


def yarn_inv_freq(dim: int):
    """HF's YaRN inverse frequencies (_compute_yarn_parameters, truncate True) in float64,
    and its attention factor."""
    import torch
    base, factor = ROPE["rope_theta"], ROPE["factor"]

    def corr(rot):
        return dim * math.log(ROPE["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(ROPE["beta_fast"])), 0), min(math.ceil(corr(ROPE["beta_slow"])), dim - 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, 0.1 * math.log(factor) + 1.0


def _float64_throughout():
    """HF's gpt-oss with the float32 steps of its float64 run made float64: RMSNorm
    (`.to(torch.float32)`) and the rope tables (float32 inverse frequencies and angles)."""
    import torch
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    def norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight.double() * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rope(self, x, position_ids):
        inv, scale = yarn_inv_freq(self.inv_freq.shape[0] * 2)
        freqs = position_ids[..., None].double() * inv
        return freqs.cos() * scale, freqs.sin() * scale
    m.GptOssRMSNorm.forward = norm
    m.GptOssRotaryEmbedding.forward = rope


def _load(model_dir: Path):
    import torch
    from transformers import GptOssForCausalLM
    torch.set_num_threads(1)
    _float64_throughout()
    return GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager",
                                             experts_implementation="eager")


def _logits(model_dir: Path, ids_path: Path, out: Path, peft_dir: str = "") -> None:
    import torch
    model = _load(model_dir)
    if peft_dir:                                  # a PEFT adapter on top (llamatune's convert-checkpoint --to peft)
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, peft_dir).to(torch.float64)
    moe_hf.save_logits(model, ids_path, out)


EXPERT_KINDS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def _experts_with_lora(self, hidden_states, router_indices=None, routing_weights=None):
    """GptOssExperts.forward plus each expert's LoRA terms (self.lora: {"gate" | "up" |
    "down": (A (E, r, n_in), B (E, n_out, r))}, self.lora_scale)."""
    import torch
    out = torch.zeros_like(hidden_states)
    lora, s = getattr(self, "lora", {}), getattr(self, "lora_scale", 0.0)

    def delta(proj, x, e):
        if proj not in lora:
            return 0
        a, b = lora[proj]
        return s * (x @ a[e].T) @ b[e].T
    for e in torch.unique(router_indices).tolist():
        token_idx, pos = torch.where(router_indices == e)
        x = hidden_states[token_idx]
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = (gate_up[..., ::2] + delta("gate", x, e)).clamp(max=self.limit)
        up = (gate_up[..., 1::2] + delta("up", x, e)).clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        y = h @ self.down_proj[e] + self.down_proj_bias[e] + delta("down", h, e)
        out.index_add_(0, token_idx, y * routing_weights[token_idx, pos, None])
    return out


def _expert_pair(model, layer: int, kind: str, a, b, scale: float):
    """Layer `layer`'s expert LoRA pair of `kind` (A (E, r, n_in), B (E, n_out, r)) as
    leaf tensors in its experts' `lora` (read by `_experts_with_lora`)."""
    import torch
    pair = [torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)]
    experts = model.base_model.model.model.layers[layer].mlp.experts
    experts.lora = getattr(experts, "lora", {}) | {EXPERT_KINDS[kind]: pair}
    experts.lora_scale = scale
    return pair


def _grads(model_dir: Path, inp: Path, out: Path) -> None:
    """moe_hf.save_lora_grads of the LoRA pairs given: attention's by PEFT, the experts' as
    `_experts_with_lora` applies them."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m
    m.GptOssExperts.forward = _experts_with_lora
    moe_hf.save_lora_grads(_load(model_dir), inp, out, _expert_pair)


# --------------------------------------------------------------------------- this side
def _quantize(src: Path, out: Path, llama_bin: Path) -> None:
    """llama-quantize src -> out as MXFP4_MOE (experts MXFP4, the other matrices Q8_0)."""
    cmd = [str(llama_bin / "llama-quantize"), str(src), str(out), "MXFP4_MOE"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def make(work: Path, torch_python: str, steps: int = 300, llama_bin: Path | None = None) -> dict[str, Path]:
    """The HF model (work/hf) and its GGUF files: F32 and Q8_0 by llama.cpp's converter,
    MXFP4_MOE by llama-quantize (when `llama_bin` is given); reused where they exist.
    Returns {"hf", "f32", "q8_0"[, "mxfp4"]} paths."""
    paths = moe_hf.make(work, torch_python, steps, ARCH, script=__file__)
    if llama_bin is not None:
        paths["mxfp4"] = work / f"{ARCH}-mxfp4.gguf"
        if not paths["mxfp4"].exists():
            _quantize(paths["f32"], paths["mxfp4"], llama_bin)
    return paths


def hf_logits(torch_python: str, model_dir: Path, ids: np.ndarray, work: Path, peft_dir: Path | None = None) -> np.ndarray:
    """HF's float64 logits (B, T, V) on ids (B, T), with the PEFT adapter `peft_dir` where given."""
    return moe_hf.hf_logits(torch_python, model_dir, ids, work, peft_dir, script=__file__)


def hf_lora_grads(torch_python: str, model_dir: Path, ids: np.ndarray, lora: dict[str, np.ndarray], r: int,
                  alpha: float, work: Path) -> dict[str, np.ndarray]:
    """HF's float64 loss ("loss") and the gradients of the LoRA pairs `lora` (names
    `blk.I.KIND.weight.lora_a` / `.lora_b`; attention and expert kinds) on ids (B, T + 1)."""
    return moe_hf.hf_lora_grads(torch_python, model_dir, ids, lora, r, alpha, work, script=__file__)


def main(argv=None) -> int:
    return moe_hf.command_line(argv, __doc__, lambda argv: moe_hf.hf_side(argv, _make_hf, _logits, _grads), make,
                               hf_logits, llama_bin=True)


if __name__ == "__main__":
    sys.exit(main())
