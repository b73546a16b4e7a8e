"""The training commands' options (`finetune`, `train-from-scratch`): the one source
of their defaults. Option names keep the historical llama.cpp `finetune` /
`train-text-from-scratch` spellings (`--lora-r`, `--adam-iter`, `--sample-start`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import LlamatuneError
from .fields import check_number, opt

G_IO, G_DATA, G_LORA, G_OPT, G_SCHED, G_MEM, G_CKPT, G_MODEL = (
    "Input and output", "Training data", "LoRA", "Optimizer", "Schedule", "Memory and speed",
    "Checkpoints", "New model")
G_VAL = "Validation and metrics"
G_PREF = "Preference tuning"
METHODS, LOSS_TYPES = ("sft", "dpo", "orpo", "grpo"), ("sigmoid", "ipo")     # --method, --loss-type (dpo)
G_GRPO = "Online RL (GRPO)"
GRPO_LOSS_TYPES, SCALE_REWARDS = ("dapo", "grpo", "bnpo", "dr_grpo"), ("group", "batch", "none")
PREFERENCE_BETA, GRPO_BETA = 0.1, 0.0        # --beta when not given: dpo/orpo, grpo (TRL's defaults)
G_FULL = "Full finetune"


WARMUP, COS_DECAY_STEPS = 100, 1000        # --warmup, --cos-decay-steps when not given (schedule_steps)
CHECKPOINTING = ("auto", "layer", "selective", "none")   # --checkpointing, auto first
SEED = 1                     # --seed of every command: training and sampling


@dataclass
class TrainOptions:
    """Options shared by `finetune` and `train-from-scratch`."""
    train_data: Optional[Path] = opt(None, "Training data: UTF-8 text, or JSONL / JSON rows (conversations, "
                                     "prompt/completion, preference pairs; see --data-format).", G_IO, needed=True)
    output_dir: Path = opt(Path("."), "Folder of the run's checkpoints, outputs, metrics and plot: the relative "
                           "output names below are placed in it (it is created if missing; the folder of any "
                           "other output must exist).", G_IO)
    overwrite: bool = opt(False, "Start a new run in a folder that holds an earlier run's LATEST files, replacing "
                          "them (without it, such a run is refused: resume it with --checkpoint-in).", G_IO,
                          switch=True)
    # ---- data
    ctx: int = opt(128, "Context length of each training sample, in tokens.", G_DATA, flags=("-c",), frozen=True)
    batch: int = opt(8, "Samples per micro-batch.", G_DATA, flags=("-b", "--batch-size"), frozen=True)
    sample_start: str = opt("", "Text that starts each sample (e.g. '<s>'); empty: every token position starts one.", G_DATA, frozen=True)
    include_sample_start: bool = opt(False, "Keep the sample-start text inside the samples.", G_DATA, frozen=True)
    escape: bool = opt(False, "Process escapes (\\n, \\t, \\\\, ...) in --sample-start.", G_DATA, frozen=True)
    overlapping_samples: bool = opt(False, "Let samples run on past the next sample start.", G_DATA, frozen=True)
    fill_with_next_samples: bool = opt(False, "Fill the rest of a short sample's context with the next samples.", G_DATA, frozen=True)
    separate_with_eos: bool = opt(False, "Put EOS between samples (with --fill-with-next-samples) and teach the model to end samples.", G_DATA, frozen=True)
    separate_with_bos: bool = opt(True, "Put BOS between samples (with --fill-with-next-samples).", G_DATA, frozen=True)
    sample_random_offsets: bool = opt(False, "Start each sample at a random offset after each reshuffle.", G_DATA, frozen=True)
    force_reshuffle: bool = opt(False, "On resume, reshuffle even if the data is unchanged.", G_DATA)
    seed: int = opt(SEED, "Random seed (initialization, shuffling, dropout).", G_DATA, frozen=True)
    # ---- optimizer
    optimizer: str = opt("adamw", "adamw or sgd.", G_OPT, frozen=True)
    adam_iter: int = opt(256, "Number of optimizer steps (iterations) to run in total.", G_OPT,
                         flags=("--max-steps", "--iters"))
    epochs: int = opt(-1, "Stop after this many epochs over the data (-1: no limit).", G_OPT)
    adam_alpha: float = opt(1e-3, "Learning rate.", G_OPT, flags=("--learning-rate", "--lr"))
    adam_min_alpha: float = opt(0.0, "Learning rate floor, warmup included.", G_OPT)
    adam_beta1: float = opt(0.9, "AdamW beta1.", G_OPT)
    adam_beta2: float = opt(0.999, "AdamW beta2.", G_OPT)
    adam_eps: float = opt(1e-8, "AdamW epsilon.", G_OPT)
    adam_decay: float = opt(0.1, "Decoupled weight decay (AdamW and SGD).", G_OPT)
    adam_decay_min_ndim: int = opt(2, "Apply weight decay only to tensors with at least this many dimensions.", G_OPT)
    adam_gclip: float = opt(1.0, "Clip the global gradient norm to this value (0: off).", G_OPT)
    grad_acc: int = opt(1, "Gradient accumulation: micro-batches per optimizer step.", G_OPT, frozen=True)
    # ---- schedule
    warmup: Optional[int] = opt(None, f"Linear warmup steps (default: {WARMUP}, scaled down with "
                                f"--cos-decay-steps's default to fit a shorter run).", G_SCHED)
    cos_decay_steps: Optional[int] = opt(None, f"Cosine decay steps after warmup (default: {COS_DECAY_STEPS}, "
                                         "scaled down with --warmup's default to fit a shorter run).", G_SCHED)
    cos_decay_min: float = opt(0.1, "Cosine decay floor, as a fraction of the learning rate.", G_SCHED)
    enable_restart: bool = opt(False, "Restart the cosine decay when it ends.", G_SCHED)
    cos_decay_restart: float = opt(1.1, "Each restart's length is the previous one times this.", G_SCHED)
    # ---- memory and speed
    use_checkpointing: Optional[bool] = opt(None, "Old spelling: on = --checkpointing selective, off = --checkpointing none (used only when --checkpointing is auto).", G_MEM)
    threads: int = opt(0, "CPU threads for kernels (0: all cores).", G_MEM, flags=("-t",))
    device: str = opt("cpu", "cpu, cuda or auto.", G_MEM)
    tf32: bool = opt(False, "GPU only: the same as --compute-dtype tf32 (float32 matmuls in TF32 on tensor cores: inputs rounded to 10 mantissa bits, float32 sums; results no longer equal the CPU's).", G_MEM)
    compute_dtype: str = opt("auto", "The frozen base's products: f32, bf16 (bf16 inputs, float32 sums, through "
                             "oneDNN: about twice the f32 rate on CPUs with AVX512_BF16 or AMX; on a GPU through "
                             "cuBLAS on tensor cores; adapters, optimizer, norms and loss stay f32), tf32 (a GPU's "
                             "float32 products in TF32), or auto (bf16 where the CPU has it natively or the GPU's "
                             "compute capability is 8.0 or newer, else f32). "
                             "A checkpoint records the choice and a resume keeps it.", G_MEM, frozen=True)
    checkpointing: str = opt("auto", "What backward recomputes: layer (keep each layer's input, recompute the layer), selective (keep matmul outputs, recompute norms and SwiGLU), none (keep everything), auto (the fastest whose memory estimate fits).", G_MEM)
    dry_run: bool = opt(False, "Load the model and data, print the memory each --checkpointing mode needs, "
                        "which one auto picks and what a save writes, then stop: nothing is trained or written.", G_MEM)
    # ---- checkpoints
    checkpoint_in: Optional[Path] = opt(None, "Resume from this checkpoint if it exists (a missing file starts fresh).", G_CKPT)
    checkpoint_out: Path = opt(Path("chk-ITERATION.gguf"), "Checkpoint file name; ITERATION becomes the step number.", G_CKPT)
    fn_latest: str = opt("LATEST", "Replacement for ITERATION in the always-current copy of each output.", G_CKPT)
    save_every: int = opt(10, "Save checkpoint and outputs every N steps (0: only at the end).", G_CKPT)
    save_total_limit: int = opt(0, "Keep only the newest N numbered checkpoints and outputs (0: keep all); the "
                                "LATEST and BEST ones are always kept.", G_CKPT)
    # ---- divergence guard (optimizer group)
    spike_threshold: float = opt(4.0, "Skip a step whose loss exceeds this factor times the mean of the last 16 "
                                 "healthy losses (non-finite loss or gradient norm: always skipped).", G_OPT)
    max_bad_steps: int = opt(5, "Stop with an error after this many skipped (bad) steps in a row.", G_OPT)
    # ---- validation and metrics
    val_data: Optional[Path] = opt(None, "Validation data, in the same format as --train-data (grpo: prompts, completed "
                                         "greedily and scored: mean reward and accuracy).", G_VAL)
    val_split: float = opt(0.0, "Hold out this fraction of the training samples (a seeded split) for validation.", G_VAL, frozen=True)
    eval_every: int = opt(10, "Validation loss at step 0, every N steps and at the end (0: at step 0 and the end).", G_VAL)
    save_best: bool = opt(False, "Keep the outputs and checkpoint of the lowest validation loss under the name with BEST in place of ITERATION.", G_VAL)
    early_stop: int = opt(0, "Stop after this many evaluations without a lower validation loss (0: never).", G_VAL)
    metrics_out: Optional[Path] = opt(None, "JSON-lines log of every step and evaluation (default: metrics.jsonl beside the checkpoints).", G_VAL)
    progress_every: float = opt(30.0, "When output is not a terminal (a log file, a batch job): a progress line "
                                "every N seconds (0: every step).", G_VAL)
    plot: bool = opt(True, "At the end, draw the metrics as a PNG beside them (needs matplotlib, the 'plot' extra).", G_VAL)
    # ---- data parallelism (distributed.py)
    mpi: bool = opt(True, "Data-parallel training across the ranks of an MPI launch (mpiexec, srun); --no-mpi ignores the MPI environment.", G_MEM)
    mpi_check_every: int = opt(10, "Under MPI: compare a checksum of the parameters across ranks every N steps (0: only at start and end).", G_MEM)
    mpi_timeout: float = opt(600.0, "Under MPI: end the job when the other ranks do not join an exchange within this many seconds (a hung rank; 0: wait for ever).", G_MEM)
    # ---- conversations and instruction data (JSONL / JSON rows)
    data_format: str = opt("auto", "text (raw text), chat (conversations), completion (prompt/completion, "
                           "instruction/output or text rows) or auto (detected from the content).", G_DATA)
    chat_template: str = opt("", "Chat template: a Jinja file or a built-in name (chatml, llama3, gemma, phi3, "
                             "mistral); default: the model's own tokenizer.chat_template.", G_DATA)
    train_on_prompt: bool = opt(False, "Train on every token of a conversation, not only the assistant answers.", G_DATA)
    skip_bad_rows: bool = opt(False, "Skip malformed data rows (and count them) instead of stopping at the first.", G_DATA)
    drop_long: bool = opt(False, "Drop conversations longer than --ctx instead of truncating them.", G_DATA)
    pack: bool = opt(False, "Pack several conversations into each context window (attention stays within each).", G_DATA)

    def check(self) -> None:
        validate(self)

    def checkpointing_mode(self) -> str:
        """--checkpointing, or what the old --use-checkpointing / --no-use-checkpointing asked for
        when --checkpointing is left at auto."""
        if self.checkpointing == "auto" and self.use_checkpointing is not None:
            return "selective" if self.use_checkpointing else "none"
        return self.checkpointing


@dataclass
class FinetuneOptions(TrainOptions):
    """`llamatune finetune`: LoRA on a frozen (quantized) base model."""
    model_base: Optional[Path] = opt(None, "Base model GGUF (any supported quant type; never modified).", G_IO,
                                     flags=("-m",), needed=True)
    lora_out: Path = opt(Path("adapter-ITERATION.gguf"), "LoRA adapter output (llama.cpp --lora format).", G_IO)
    imatrix_out: Optional[Path] = opt(None, "Importance matrix of the training data (llama.cpp's imatrix GGUF: the "
                                      "base weights' input statistics, collected by the forward passes), written "
                                      "with each adapter, for llama-quantize --imatrix and export-lora (which finds it by "
                                      "itself under the default name: --lora-out's, ending .imatrix.gguf). LoRA, "
                                      "--method sft.", G_IO)
    merge_aware: bool = opt(False, "Train for a quantized merge: each adapted quantized matrix's forward uses "
                            "Q(W + s B A), requantized to the base tensor's type, with a straight-through gradient, "
                            "so that export-lora --merge-method plain keeps what was trained. Costs, per adapted quantized "
                            "matrix and micro-batch, a full-size f32 copy quantized and dequantized on the host, in "
                            "forward and again in backward (counted in the memory estimate's scratch).", G_LORA,
                            frozen=True)
    lora_r: int = opt(4, "Default LoRA rank for every adapted tensor.", G_LORA, frozen=True)
    lora_alpha: Optional[float] = opt(None, "LoRA alpha; scale = alpha/r (default: alpha = r, scale 1).", G_LORA,
                                      frozen=True)
    lora_dropout: float = opt(0.0, "Dropout probability on the adapter input (as PEFT).", G_LORA, frozen=True)
    rank_wq: Optional[int] = opt(None, "Rank for attn_q (default --lora-r; 0: no adapter).", G_LORA, frozen=True)
    rank_wk: Optional[int] = opt(None, "Rank for attn_k.", G_LORA, frozen=True)
    rank_wv: Optional[int] = opt(None, "Rank for attn_v.", G_LORA, frozen=True)
    rank_wo: Optional[int] = opt(None, "Rank for attn_output.", G_LORA, frozen=True)
    rank_wqkv: Optional[int] = opt(None, "Rank for the fused attn_qkv of models that have one (phi3).", G_LORA, frozen=True)
    rank_ffn_gate: Optional[int] = opt(None, "Rank for ffn_gate (and a shared expert's ffn_gate_shexp).", G_LORA,
                                       frozen=True)
    rank_ffn_up: Optional[int] = opt(None, "Rank for ffn_up (and ffn_up_shexp).", G_LORA, frozen=True)
    rank_ffn_down: Optional[int] = opt(None, "Rank for ffn_down (and ffn_down_shexp).", G_LORA, frozen=True)
    rank_ffn_exps: Optional[int] = opt(None, "Rank of the per-expert adapters on a mixture of experts' "
                                       "ffn_gate_exps, ffn_up_exps and ffn_down_exps (default --lora-r).",
                                       G_LORA, frozen=True)
    no_lora_experts: bool = opt(False, "No adapters on the experts of a mixture of experts (attention, and the "
                                "router where --rank-ffn-gate-inp asks, only).", G_LORA, frozen=True)
    rank_ffn_gate_inp: int = opt(0, "Rank for a mixture of experts' router ffn_gate_inp (and a shared expert's "
                                 "gate ffn_gate_inp_shexp; 0: frozen, unless --train-router).", G_LORA, frozen=True)
    train_router: bool = opt(False, "Train a mixture of experts' router ffn_gate_inp through an adapter of rank "
                             "--lora-r (or --rank-ffn-gate-inp where given).", G_LORA, frozen=True)
    router_aux_loss_coef: float = opt(0.0, "Weight of a mixture of experts' load-balancing loss (Hugging Face's "
                                      "router_aux_loss_coef, Switch Transformer's auxiliary loss over every layer's "
                                      "router; 0: none, as PEFT recipes for LoRA).", G_LORA)
    rank_attn_gate: Optional[int] = opt(None, "Rank for attn_gate, the delta-net layers' output gate projection "
                                        "(qwen35).", G_LORA, frozen=True)
    rank_ssm_out: Optional[int] = opt(None, "Rank for ssm_out, the delta-net layers' output projection (qwen35).",
                                      G_LORA, frozen=True)
    rank_ssm_alpha: int = opt(0, "Rank for ssm_alpha, the delta-net layers' decay gate projection (qwen35; 0: none).",
                              G_LORA, frozen=True)
    rank_ssm_beta: int = opt(0, "Rank for ssm_beta, the delta-net layers' write-strength gate projection (qwen35; "
                             "0: none).", G_LORA, frozen=True)
    rank_tok_embd: int = opt(0, "Rank for token_embd (0: none).", G_LORA, frozen=True)
    rank_out: int = opt(0, "Rank for the output head (0: none).", G_LORA, frozen=True)
    rank_att_norm: int = opt(0, "Rank for attn_norm (llama.cpp ignores norm adapters at run time; export-lora merges them).", G_LORA, frozen=True)
    rank_ffn_norm: int = opt(0, "Rank for ffn_norm (see --rank-att-norm).", G_LORA, frozen=True)
    rank_out_norm: int = opt(0, "Rank for output_norm (see --rank-att-norm).", G_LORA, frozen=True)
    rank_q_norm: int = opt(0, "Rank for attn_q_norm, the per-head q norm of qwen3 and gemma3 (see --rank-att-norm).", G_LORA, frozen=True)
    rank_k_norm: int = opt(0, "Rank for attn_k_norm, the per-head k norm of qwen3 and gemma3 (see --rank-att-norm).", G_LORA, frozen=True)
    rank_post_att_norm: int = opt(0, "Rank for post_attention_norm of gemma2 and gemma3 (see --rank-att-norm).", G_LORA, frozen=True)
    rank_post_ffn_norm: int = opt(0, "Rank for post_ffw_norm of gemma2 and gemma3 (see --rank-att-norm).", G_LORA, frozen=True)
    # ---- preference (DPO, IPO, cDPO, ORPO on chosen/rejected pairs: train/preference.py)
    method: str = opt("sft", "sft (next-token loss on the data), dpo (chosen/rejected pairs against the base "
                      "model with the adapter off) or orpo (SFT on chosen plus an odds-ratio term; no reference).",
                      G_PREF, frozen=True)
    beta: Optional[float] = opt(None, f"dpo: the beta of the implicit reward (higher stays closer to the base "
                                f"model); orpo: the weight lambda of the odds-ratio term (both default "
                                f"{PREFERENCE_BETA}); grpo: the weight of the KL term to the base with the adapter "
                                f"off (default {GRPO_BETA}, TRL's: no reference pass).", G_PREF, frozen=True)
    loss_type: Optional[str] = opt(None, "dpo: sigmoid (DPO, the default) or ipo (IPO: squared loss on "
                                   "length-averaged log-probabilities); grpo: the loss normalisation, dapo (TRL's "
                                   "default: over the step's completion tokens), grpo (per completion, then over "
                                   "completions), bnpo (over each micro-batch's tokens) or dr_grpo (over completions "
                                   "x --max-completion-length).", G_PREF, frozen=True)
    label_smoothing: float = opt(0.0, "dpo --loss-type sigmoid: the assumed fraction of pairs labelled the wrong "
                                 "way round (cDPO), in [0, 0.5).", G_PREF, frozen=True)
    # ---- online RL (--method grpo: train/grpo.py, HF TRL's GRPOTrainer)
    reward: list[str] = opt([], "grpo: a reward of each completion; repeatable, the rewards add up: boxed-answer "
                            "(1 where the last \\boxed{...} equals the row's 'answer'), regex:PATTERN (1 where it "
                            "matches), FILE.py:FUNCTION or MODULE:FUNCTION (TRL's signature: prompts, completions, "
                            "**row_fields -> list of floats).", G_GRPO)
    reward_weights: list[float] = opt([], "grpo: one weight per --reward, in order (default: 1 each).", G_GRPO)
    num_generations: int = opt(8, "grpo: completions sampled per prompt (the group); --batch must be a multiple.",
                               G_GRPO, frozen=True)
    max_completion_length: int = opt(256, "grpo: the most tokens a completion has; a prompt and its completion "
                                     "share a row of --ctx + 1 tokens.", G_GRPO, frozen=True)
    temperature: float = opt(1.0, "grpo: sampling temperature (> 0).", G_GRPO, frozen=True)
    top_p: float = opt(1.0, "grpo: nucleus sampling threshold (1 = off).", G_GRPO, frozen=True)
    epsilon: float = opt(0.2, "grpo: the ratio's clipping range below 1 (and above, without --epsilon-high).",
                         G_GRPO, frozen=True)
    epsilon_high: Optional[float] = opt(None, "grpo: the clipping range above 1 (default --epsilon; DAPO "
                                        "suggests 0.28).", G_GRPO, frozen=True)
    num_iterations: int = opt(1, "grpo: optimizer steps taken on each generated batch (TRL's num_iterations, its "
                              "mu): the first step samples and scores, the next ones reuse those completions, "
                              "their ratios taken against the sampling policy's log-probabilities.",
                              G_GRPO, frozen=True)
    scale_rewards: str = opt("group", "grpo: advantages divided by the group's reward std (group), the batch's "
                             "(batch) or not at all (none).", G_GRPO, frozen=True)
    # ---- full finetune (--fine-tune-type full, train/full.py)
    fine_tune_type: str = opt("lora", "lora (adapters on the frozen base) or full (every weight of the base "
                              "trained in f32, quantized ones dequantized; writes --model-out).", G_FULL, frozen=True)
    adam_moments: str = opt("f32", "With --fine-tune-type full and AdamW: keep the two moments in f32, or in bf16 "
                            "(round to nearest even after each update; 4 bytes a trained value instead of 8, "
                            "2.35 GiB less for a 0.5B model; the CPU only).", G_OPT, frozen=True)
    train_only: str = opt("", "Full: train only the tensors whose names match these comma-separated patterns "
                          "(fnmatch, e.g. 'blk.*.ffn_*'); the others stay frozen as stored.", G_FULL, frozen=True)
    freeze: str = opt("", "Full: keep the tensors matching these comma-separated patterns frozen as stored "
                      "(e.g. 'token_embd.*'); they are written back byte for byte.", G_FULL, frozen=True)
    model_out: Path = opt(Path("model-ITERATION.gguf"), "Full: the trained model (a GGUF llama.cpp runs, with the "
                          "base's metadata and tokenizer).", G_FULL)
    out_type: str = opt("", "Full: type of the written matrices: f32, f16, bf16, q8_0, q4_k, ...; empty: each "
                        "tensor in the base's own type (re-quantized).", G_FULL)

    def __post_init__(self):
        self.beta, self.loss_type = method_defaults(self)     # --method's defaults where not given

    def unwritten_outputs(self) -> tuple[str, ...]:
        """Output options this run does not write (neither checked nor locked): a LoRA run
        writes no --model-out, a full finetune no --lora-out."""
        return ("model_out",) if self.fine_tune_type == "lora" else ("lora_out", "imatrix_out")

    def ranks(self) -> dict[str, int]:
        """Adapter rank per tensor kind (llama.cpp names)."""
        r = self.lora_r
        pick = lambda v: r if v is None else v  # noqa: E731
        return {"attn_q": pick(self.rank_wq), "attn_k": pick(self.rank_wk), "attn_v": pick(self.rank_wv),
                "attn_qkv": pick(self.rank_wqkv), "attn_output": pick(self.rank_wo), "ffn_gate": pick(self.rank_ffn_gate),
                "ffn_up": pick(self.rank_ffn_up), "ffn_down": pick(self.rank_ffn_down),
                "attn_gate": pick(self.rank_attn_gate), "ssm_out": pick(self.rank_ssm_out),
                "ssm_alpha": self.rank_ssm_alpha, "ssm_beta": self.rank_ssm_beta,
                "token_embd": self.rank_tok_embd, "output": self.rank_out, "attn_norm": self.rank_att_norm,
                "ffn_norm": self.rank_ffn_norm, "output_norm": self.rank_out_norm,
                "attn_q_norm": self.rank_q_norm, "attn_k_norm": self.rank_k_norm,
                "post_attention_norm": self.rank_post_att_norm, "post_ffw_norm": self.rank_post_ffn_norm,
                "ffn_gate_inp": self.rank_ffn_gate_inp or (self.lora_r if self.train_router else 0),
                "ffn_gate_inp_shexp": self.rank_ffn_gate_inp,
                # a shared expert (qwen35moe) is a dense SwiGLU: the feed-forward's ranks
                "ffn_gate_shexp": pick(self.rank_ffn_gate), "ffn_up_shexp": pick(self.rank_ffn_up),
                "ffn_down_shexp": pick(self.rank_ffn_down)} | {
                k: 0 if self.no_lora_experts else pick(self.rank_ffn_exps)
                for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}


@dataclass
class ScratchOptions(TrainOptions):
    """`llamatune train-from-scratch`: a new model (`--arch`), all parameters trained."""
    vocab_model: Optional[Path] = opt(None, "Copy the vocabulary from this GGUF (vocab-only or full model).", G_IO)
    vocab_size: int = opt(4096, "Without --vocab-model: train a SentencePiece vocabulary of this size on the data.", G_MODEL, frozen=True)
    special_tokens: str = opt("", "Without --vocab-model: control tokens to add to the trained vocabulary, comma-separated "
                              "(e.g. '<|im_start|>,<|im_end|>' for ChatML chat data; generation ends at <|im_end|>).",
                              G_MODEL, frozen=True)
    model_out: Path = opt(Path("model-ITERATION.gguf"), "Model output GGUF.", G_IO)
    outtype: str = opt("f32", "Model output type: f32, f16 or q8_0.", G_IO)
    arch: str = opt("llama", "Architecture of the new model: one declared in llamatune/models/archs/ that "
                    "trains from scratch (llama, qwen2, phi3, ...; an unknown name lists them).", G_MODEL, frozen=True)
    embd: int = opt(256, "Embedding size.", G_MODEL, frozen=True)
    head: int = opt(8, "Attention heads.", G_MODEL, frozen=True)
    head_kv: Optional[int] = opt(None, "KV heads for GQA (default: --head).", G_MODEL, frozen=True)
    layer: int = opt(4, "Layers.", G_MODEL, frozen=True)
    ff: Optional[int] = opt(None, "Feed-forward size (default: llama's rule from --embd).", G_MODEL, frozen=True)
    norm_rms_eps: float = opt(1e-5, "RMSNorm epsilon.", G_MODEL, frozen=True)
    rope_freq_base: float = opt(10000.0, "RoPE frequency base.", G_MODEL, frozen=True)


def validate(o: TrainOptions) -> None:
    def bad(msg):
        raise LlamatuneError(msg)
    if o.ctx < 2:
        bad(f"--ctx {o.ctx}: must be at least 2")
    if o.batch < 1:
        bad(f"--batch {o.batch}: must be at least 1")
    if o.grad_acc < 1:
        bad(f"--grad-acc {o.grad_acc}: must be at least 1")
    if o.adam_iter < 1:
        bad(f"--adam-iter {o.adam_iter}: must be at least 1")
    if o.optimizer not in ("adamw", "sgd"):
        bad(f"--optimizer {o.optimizer!r}: choose adamw or sgd")
    if o.checkpointing not in CHECKPOINTING:
        bad(f"--checkpointing {o.checkpointing!r}: choose {', '.join(CHECKPOINTING)}")
    if o.device not in ("cpu", "cuda", "auto"):
        bad(f"--device {o.device!r}: choose cpu, cuda or auto")
    if o.tf32 and o.device == "cpu":
        bad("--tf32 runs matmuls on a GPU's tensor cores: it needs --device cuda or auto")
    if o.compute_dtype == "tf32" and o.device == "cpu":
        bad("--compute-dtype tf32 runs matmuls on a GPU's tensor cores: it needs --device cuda or auto")
    if not o.adam_alpha > 0:
        bad(f"--adam-alpha {o.adam_alpha}: must be positive")
    if o.data_format not in ("auto", "text", "chat", "completion"):
        bad(f"--data-format {o.data_format!r}: choose auto, text, chat or completion")
    if o.save_every < 0:
        bad(f"--save-every {o.save_every}: must be 0 or more")
    _validate_numbers(o)
    _validate_validation(o)
    if isinstance(o, FinetuneOptions):
        if o.lora_r < 1:
            bad(f"--lora-r {o.lora_r}: must be at least 1")
        if not 0 <= o.lora_dropout < 1:
            bad(f"--lora-dropout {o.lora_dropout}: must be in [0, 1)")
        if not 0 <= o.router_aux_loss_coef < float("inf"):
            bad(f"--router-aux-loss-coef {o.router_aux_loss_coef}: must be 0 or more")
        negative = [k for k, r in o.ranks().items() if r < 0]
        if negative:
            bad(f"negative LoRA rank for {', '.join(negative)}")
        if o.fine_tune_type not in ("lora", "full"):
            bad(f"--fine-tune-type {o.fine_tune_type!r}: choose lora or full")
        if o.adam_moments not in ("f32", "bf16"):
            bad(f"--adam-moments {o.adam_moments!r}: choose f32 or bf16")
        if o.adam_moments == "bf16" and (o.fine_tune_type != "full" or o.optimizer != "adamw"):
            bad("--adam-moments bf16 is for --fine-tune-type full with AdamW (an adapter's moments are small)")
        if o.adam_moments == "bf16" and o.device != "cpu":
            bad("--adam-moments bf16 runs on the CPU (--device cpu)")
        if o.fine_tune_type == "lora" and (o.train_only or o.freeze or o.out_type):
            given = [f for f, v in (("--train-only", o.train_only), ("--freeze", o.freeze), ("--out-type", o.out_type)) if v]
            bad(f"{', '.join(given)}: only with --fine-tune-type full")
        if o.fine_tune_type == "lora" and not any(o.ranks().values()):
            bad("every LoRA rank is 0: nothing to train")
        _validate_preference(o)


def _validate_validation(o: TrainOptions) -> None:
    """Validation options: one source of samples, and what --save-best and --early-stop need."""
    if o.val_split and o.val_data is not None:
        raise LlamatuneError("--val-data and --val-split: give only one source of validation samples")
    has_val = o.val_data is not None or o.val_split > 0
    if (o.save_best or o.early_stop) and not has_val:
        raise LlamatuneError(f"{'--save-best' if o.save_best else '--early-stop'} needs validation samples: "
                             "give --val-data or --val-split")
    for name in ("checkpoint_out", "lora_out", "model_out") if o.save_best else ():
        path = getattr(o, name, None)           # the outputs this command has
        if path is not None and "ITERATION" not in str(path):
            raise LlamatuneError(f"--save-best: --{name.replace('_', '-')} {path} has no ITERATION to replace by BEST")


def _validate_preference(o: FinetuneOptions) -> None:
    """--method and what preference methods need (pairs are two rows of a micro-batch)."""
    if o.method not in METHODS:
        raise LlamatuneError(f"--method {o.method!r}: choose {', '.join(METHODS)}")
    grpo = o.method == "grpo"
    types = GRPO_LOSS_TYPES if grpo else LOSS_TYPES
    if o.loss_type not in types:
        raise LlamatuneError(f"--loss-type {o.loss_type!r}: choose {', '.join(types)} (--method {o.method})")
    check_number("--beta", o.beta, 0, lo_open=not grpo)
    check_number("--label-smoothing", o.label_smoothing, 0, 0.5, hi_open=True)
    if o.method == "sft":
        return
    if grpo:
        _validate_grpo(o)
        return
    if o.batch % 2:
        raise LlamatuneError(f"--batch {o.batch}: --method {o.method} puts a pair's chosen and rejected answers in "
                             "two rows of a micro-batch: give an even --batch")
    if o.pack:
        raise LlamatuneError(f"--pack: --method {o.method} trains on whole pairs, one answer per row; "
                             "train without --pack")
    if o.lora_dropout:
        raise LlamatuneError(f"--lora-dropout {o.lora_dropout}: --method {o.method} weighs each answer by "
                             "log-probabilities measured without dropout; use --lora-dropout 0")
    if o.label_smoothing and (o.method != "dpo" or o.loss_type != "sigmoid"):
        raise LlamatuneError("--label-smoothing applies to --method dpo --loss-type sigmoid only")
    if o.train_on_prompt:
        raise LlamatuneError(f"--train-on-prompt: --method {o.method} scores the answers only")


def method_defaults(o: FinetuneOptions) -> tuple[float, str]:
    """(--beta, --loss-type) as --method uses them: the values given, or the method's defaults."""
    grpo = o.method == "grpo"
    beta = o.beta if o.beta is not None else GRPO_BETA if grpo else PREFERENCE_BETA
    return beta, o.loss_type if o.loss_type is not None else (GRPO_LOSS_TYPES if grpo else LOSS_TYPES)[0]


def _validate_grpo(o: FinetuneOptions) -> None:
    """What --method grpo needs: whole groups in a micro-batch, room for a completion, LoRA
    adapters the sampler applies (no norm adapters), no dropout."""
    G = o.num_generations
    check_number("--num-generations", G, 2)
    if o.batch % G:
        raise LlamatuneError(f"--batch {o.batch}: --method grpo puts whole groups of --num-generations {G} "
                             "completions in a micro-batch: give a multiple of it")
    check_number("--max-completion-length", o.max_completion_length, 1)
    check_number("--num-iterations", o.num_iterations, 1)
    if o.max_completion_length >= o.ctx:
        raise LlamatuneError(f"--max-completion-length {o.max_completion_length} leaves no room for a prompt in "
                             f"--ctx {o.ctx} (a prompt and its completion share a row): raise --ctx or lower it")
    check_number("--temperature", o.temperature, 0, lo_open=True)
    check_number("--top-p", o.top_p, 0, 1, lo_open=True)
    check_number("--epsilon", o.epsilon, 0, 1, hi_open=True)
    if o.epsilon_high is not None:
        check_number("--epsilon-high", o.epsilon_high, 0)
    if o.scale_rewards not in SCALE_REWARDS:
        raise LlamatuneError(f"--scale-rewards {o.scale_rewards!r}: choose {', '.join(SCALE_REWARDS)}")
    if o.reward_weights and len(o.reward_weights) != len(o.reward):
        raise LlamatuneError(f"--reward-weights: {len(o.reward_weights)} weight(s) for {len(o.reward)} --reward")
    given = [f for f, v in (("--pack", o.pack), ("--train-on-prompt", o.train_on_prompt), ("--label-smoothing", o.label_smoothing),
                            ("--val-split", o.val_split), ("--lora-dropout", o.lora_dropout),
                            ("--merge-aware", o.merge_aware)) if v]
    if o.fine_tune_type != "lora":
        given.append("--fine-tune-type full")
    norms = [k for k, r in o.ranks().items() if r and k.endswith("norm")]
    if norms:
        given.append(f"norm adapters ({', '.join(norms)}: the sampler does not apply them)")
    if given:
        raise LlamatuneError(f"--method grpo trains LoRA adapters on sampled completions: not with {', '.join(given)}")


def _validate_numbers(o: TrainOptions) -> None:
    """Range checks of the numeric options not checked above (every one is checked somewhere)."""
    check_number("--seed", o.seed, 0)
    check_number("--epochs", o.epochs, 1, also=(-1,))
    check_number("--adam-alpha", o.adam_alpha, 0, lo_open=True)
    check_number("--adam-min-alpha", o.adam_min_alpha, 0, o.adam_alpha)
    check_number("--adam-beta1", o.adam_beta1, 0, 1, hi_open=True)
    check_number("--adam-beta2", o.adam_beta2, 0, 1, hi_open=True)
    check_number("--adam-eps", o.adam_eps, 0, lo_open=True)
    check_number("--adam-decay", o.adam_decay, 0)
    check_number("--adam-decay-min-ndim", o.adam_decay_min_ndim, 0)
    check_number("--adam-gclip", o.adam_gclip, 0)
    if o.warmup is not None:
        check_number("--warmup", o.warmup, 0)
    if o.cos_decay_steps is not None:
        check_number("--cos-decay-steps", o.cos_decay_steps, 0)
    check_number("--save-total-limit", o.save_total_limit, 0)
    check_number("--progress-every", o.progress_every, 0)
    check_number("--cos-decay-min", o.cos_decay_min, 0, 1)
    check_number("--cos-decay-restart", o.cos_decay_restart, 1)
    check_number("--threads", o.threads, 0)
    check_number("--spike-threshold", o.spike_threshold, 1, lo_open=True)
    check_number("--max-bad-steps", o.max_bad_steps, 1)
    check_number("--val-split", o.val_split, 0, 1, hi_open=True)
    check_number("--eval-every", o.eval_every, 0)
    check_number("--early-stop", o.early_stop, 0)
    check_number("--mpi-check-every", o.mpi_check_every, 0)
    check_number("--mpi-timeout", o.mpi_timeout, 0)
    if isinstance(o, FinetuneOptions):
        if o.lora_alpha is not None:
            check_number("--lora-alpha", o.lora_alpha, 0, lo_open=True)
        check_number("--lora-dropout", o.lora_dropout, 0, 1, hi_open=True)
    if isinstance(o, ScratchOptions):
        check_number("--vocab-size", o.vocab_size, 8)
        special_tokens(o)
        for flag, v in (("--embd", o.embd), ("--head", o.head), ("--layer", o.layer)):
            check_number(flag, v, 1)
        if o.head_kv is not None:
            check_number("--head-kv", o.head_kv, 1, o.head)
            if o.head % o.head_kv:
                raise LlamatuneError(f"--head-kv {o.head_kv}: must divide --head {o.head}")
        if o.ff is not None:
            check_number("--ff", o.ff, 1)
        check_number("--norm-rms-eps", o.norm_rms_eps, 0, lo_open=True)
        check_number("--rope-freq-base", o.rope_freq_base, 0, lo_open=True)


def special_tokens(o: ScratchOptions) -> tuple[str, ...]:
    """--special-tokens as a tuple, checked: distinct, non-empty, no spaces, no vocabulary to copy."""
    toks = tuple(t.strip() for t in o.special_tokens.split(",")) if o.special_tokens.strip() else ()
    if toks and o.vocab_model is not None:
        raise LlamatuneError("--special-tokens adds tokens to a trained vocabulary; --vocab-model brings its own")
    for t in toks:
        if not t or any(c.isspace() for c in t) or toks.count(t) > 1:
            raise LlamatuneError(f"--special-tokens {o.special_tokens!r}: give distinct tokens without spaces, "
                                 "separated by commas")
    return toks


def schedule_steps(o: TrainOptions) -> tuple[int, int, str]:
    """(warmup, cosine decay steps, note) as the run uses them. A value given (not None)
    is kept; the defaults (WARMUP, COS_DECAY_STEPS) of those not given are scaled down
    together, to fill what the given ones leave of --adam-iter, when warmup and decay
    would outlast the run (a 4-step run would otherwise end at 4 % of the learning
    rate, still warming up). `note`: one line saying so ("" when nothing was scaled)."""
    given = {"warmup": o.warmup, "cos_decay_steps": o.cos_decay_steps}
    steps = {k: v if v is not None else d for (k, v), d in zip(given.items(), (WARMUP, COS_DECAY_STEPS))}
    scaled = [k for k, v in given.items() if v is None]
    if sum(steps.values()) <= o.adam_iter or not scaled:
        return steps["warmup"], steps["cos_decay_steps"], ""
    room = max(o.adam_iter - sum(v for k, v in steps.items() if k not in scaled), 0)
    total = sum(steps[k] for k in scaled)
    before = dict(steps)
    for k in scaled:
        steps[k] = round(steps[k] * room / total)
    if "cos_decay_steps" in scaled:                 # together they fill the room exactly
        steps["cos_decay_steps"] = room - (steps["warmup"] if "warmup" in scaled else 0)
    names = " and ".join(f"--{k.replace('_', '-')} {before[k]} -> {steps[k]}" for k in scaled)
    return steps["warmup"], steps["cos_decay_steps"], (
        f"schedule: {names}, scaled to the run's {o.adam_iter} steps (give them to keep them, and to keep one "
        "schedule across resumes with other --adam-iter)")
