"""The options of the commands other than training (perplexity, generate, chat,
tokenize, export-lora, convert-checkpoint, plot, quickstart, preview-data): declared
once here as the training options are; cli/options_cli.py builds each command's
flags from these fields (group None: the help's plain "Options" section)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from ..errors import LlamatuneError
from .fields import check_number, opt
from .training import SEED

G_MERGE = "Merge"
MERGE_METHODS = ("compensated", "plain")

LORA_HELP = "LoRA adapter (GGUF) applied at run time with scale 1; repeatable."
LORA_SCALED_HELP = "LoRA adapter with a user scale, as FILE:SCALE; repeatable."


@dataclass
class RunOptions:
    """A model to run, with adapters applied at run time (perplexity, generate, chat)."""
    model: Optional[Path] = opt(None, "GGUF model.", None, flags=("-m",), required=True)
    lora: list[Path] = opt([], LORA_HELP, None)
    lora_scaled: list[str] = opt([], LORA_SCALED_HELP, None)
    device: str = opt("cpu", "cpu, cuda or auto (cuda when a GPU is visible).", None)
    compute_dtype: str = opt("auto", "The base's products: f32 (the same digits as llama.cpp's F32 path), bf16 "
                             "(bf16 inputs, f32 sums, through oneDNN: about twice the f32 rate on CPUs with "
                             "AVX512_BF16 or AMX), or auto (bf16 where the CPU has it natively, else f32).", None)
    allow_nonfinite: bool = opt(False, "Run even when weights hold inf or nan (a notice names them; results "
                                "may be nan).", None, switch=True)

    def check(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise LlamatuneError(f"--device {self.device!r}: choose cpu, cuda or auto")
        scaled_adapters(self.lora_scaled)


@dataclass
class PerplexityOptions(RunOptions):
    """`llamatune perplexity`."""
    file: Optional[Path] = opt(None, "Text file to score.", None, flags=("-f",), required=True)
    ctx: int = opt(512, "Window size in tokens.", None, flags=("-c",))
    batch: int = opt(2048, "Tokens per forward pass (whole windows are batched).", None, flags=("-b",))
    # perplexity keeps f32 by default: its figure then agrees with llama-perplexity's to the printed digit
    compute_dtype: str = opt("f32", "The base's products: f32 (the default here: the same digits as "
                             "llama-perplexity), bf16 (bf16 inputs, f32 sums, through oneDNN: faster on CPUs with "
                             "AVX512_BF16 or AMX), or auto (bf16 where the CPU has it natively, else f32).", None)

    def check(self) -> None:
        super().check()
        check_number("-b/--batch", self.batch, 1)


@dataclass
class SamplingOptions:
    """How generate and chat pick tokens (llama.cpp's order: top-k, top-p, temperature)."""
    n_predict: int = opt(64, "Tokens to generate (-1: until EOS or the context is full).", None, flags=("-n",))
    temp: float = opt(0.8, "Temperature; 0 = greedy.", None)
    top_k: int = opt(40, "Keep the k most likely tokens (0 = all).", None)
    top_p: float = opt(0.95, "Nucleus sampling threshold (1 = off).", None)
    seed: int = opt(SEED, "Random seed.", None)
    ctx: Optional[int] = opt(None, "Context size (default: the model's).", None, flags=("-c",))

    def check(self) -> None:
        check_number("-n/--n-predict", self.n_predict, 0, also=(-1,))
        check_number("--temp", self.temp, 0)
        check_number("--top-k", self.top_k, 0)
        check_number("--top-p", self.top_p, 0, 1, lo_open=True)
        check_number("--seed", self.seed, 0)
        if self.ctx is not None:
            check_number("-c/--ctx", self.ctx, 1)


@dataclass
class GenerateOptions(SamplingOptions, RunOptions):
    """`llamatune generate`."""
    prompt: Optional[str] = opt(None, "Prompt text.", None, flags=("-p",), required=True)

    def check(self) -> None:
        RunOptions.check(self)
        SamplingOptions.check(self)


@dataclass
class ChatSampling(SamplingOptions):
    """Sampling of `llamatune chat`: longer answers by default."""
    n_predict: int = opt(256, "Most tokens per answer.", None, flags=("-n",))


@dataclass
class ChatOptions(ChatSampling, RunOptions):
    """`llamatune chat`."""
    model: Optional[Path] = opt(None, "GGUF model with a chat template (or use --chat-template).", None,
                                flags=("-m",), required=True)
    prompt: Optional[str] = opt(None, "Answer this one message and exit.", None, flags=("-p",))
    system: Optional[str] = opt(None, "System message.", None, flags=("-s",))
    chat_template: Optional[str] = opt(None, "Jinja file or built-in name (chatml, llama3, gemma, phi3, "
                                       "mistral).", None)

    def check(self) -> None:
        RunOptions.check(self)
        SamplingOptions.check(self)

    def sampling(self) -> ChatSampling:
        return ChatSampling(**{f.name: getattr(self, f.name) for f in fields(ChatSampling)})


@dataclass
class TokenizeOptions:
    """`llamatune tokenize`."""
    model: Optional[Path] = opt(None, "GGUF model or vocab-only GGUF.", None, flags=("-m",), required=True)
    prompt: Optional[str] = opt(None, "Text to tokenize.", None, flags=("-p",))
    file: Optional[Path] = opt(None, "Tokenize this file's exact text.", None, flags=("-f",))
    ids: bool = opt(False, "Print only the ids, as one list: [1, 15043, 3186].", None, switch=True)
    no_bos: bool = opt(False, "Add no special tokens (BOS/EOS).", None, switch=True)

    def check(self) -> None:
        if (self.prompt is None) == (self.file is None):
            raise LlamatuneError("give exactly one of -p/--prompt and -f/--file")


@dataclass
class MergeOptions:
    """How export-lora re-quantizes merged weights, and the Ollama hand-off (#31)."""
    merge_method: str = opt("compensated", "compensated: re-quantize merged weights to minimize the output error "
                            "(llama.cpp's imatrix-weighted quantizers; with --calibration-data also GPTQ-style error "
                            "compensation), keeping a base block where it is as close; plain: round to nearest "
                            "(llama-quantize without an imatrix).", G_MERGE)
    imatrix: Optional[Path] = opt(None, "Importance matrix GGUF (llama-imatrix's, or --imatrix-out's) weighting "
                                  "the merged weights' input columns.", G_MERGE)
    calibration_data: Optional[Path] = opt(None, "Text to run the base + adapters over, collecting each merged "
                                           "weight's input statistics (importance and second moment).", G_MERGE)
    calibration_ctx: int = opt(512, "Tokens per calibration window.", G_MERGE)
    calibration_chunks: int = opt(4, "Calibration windows at most (the text's first ones); the calibration "
                                  "forward's time grows with them (16 kept no more of an adapter than 4).", G_MERGE)
    calibration_block: int = opt(1024, "Keep each input's second moment as diagonal blocks of this many columns "
                                 "(errors are carried within a block only; 0: the whole matrix, much slower "
                                 "for wide inputs such as ffn_down's).", G_MERGE)
    calibration_memory: int = opt(2048, "MiB of input second moments held at once; more needs further passes "
                                  "over the calibration text.", G_MERGE)
    imatrix_out: Optional[Path] = opt(None, "Write the statistics of --calibration-data as an imatrix GGUF "
                                      "(usable by llama-quantize --imatrix).", G_MERGE)
    ollama: Optional[Path] = opt(None, "Also write DIR/Modelfile for `ollama create NAME -f DIR/Modelfile`.", G_MERGE)

    def check(self) -> None:
        if self.merge_method not in MERGE_METHODS:
            raise LlamatuneError(f"--merge-method {self.merge_method!r}: choose {' or '.join(MERGE_METHODS)}")
        for flag, value in (("--calibration-ctx", self.calibration_ctx), ("--calibration-chunks", self.calibration_chunks),
                            ("--calibration-memory", self.calibration_memory)):
            if value < 1:
                raise LlamatuneError(f"{flag} {value}: must be at least 1")
        if self.calibration_block < 0 or self.calibration_block % 256:
            raise LlamatuneError(f"--calibration-block {self.calibration_block}: must be 0 or a multiple of 256 "
                                 "(the K-quants' block)")
        if self.imatrix_out is not None and self.calibration_data is None:
            raise LlamatuneError("--imatrix-out needs --calibration-data (the statistics it writes)")
        if self.merge_method == "plain" and (self.imatrix or self.calibration_data):
            raise LlamatuneError("--merge-method plain uses no statistics: drop --imatrix/--calibration-data "
                                 "or use --merge-method compensated")


@dataclass
class ExportOptions(MergeOptions):
    """`llamatune export-lora`."""
    model_base: Optional[Path] = opt(None, "Base model GGUF.", None, flags=("-m",), required=True)
    lora: list[Path] = opt([], "Adapter to merge with scale 1; repeatable.", None)
    lora_scaled: list[str] = opt([], "Adapter with a user scale, FILE:SCALE; repeatable.", None)
    output: Optional[Path] = opt(None, "Merged model GGUF to write.", None, flags=("-o",), required=True)
    outtype: str = opt("same", "same (keep each tensor's type, quantized ones re-quantized), or f32, f16, bf16, "
                       "q8_0, q4_0, q4_1, q5_0, q5_1, q2_k..q6_k.", None)

    def check(self) -> None:
        scaled_adapters(self.lora_scaled)
        super().check()

    def adapters(self) -> list[tuple[Path, float]]:
        return [(Path(p), 1.0) for p in self.lora] + [(Path(p), s) for p, s in scaled_adapters(self.lora_scaled)]


@dataclass
class ConvertOptions:
    """`llamatune convert-checkpoint`."""
    input: Optional[Path] = opt(None, "Checkpoint, adapter, PEFT directory, 2023 checkpoint or ggla .bin.", None,
                                argument=True, required=True)
    output: Optional[Path] = opt(None, "File or directory to write.", None, flags=("-o",), required=True)
    to: Optional[str] = opt(None, "gguf-adapter, peft, checkpoint or model (default: the usual target for the "
                            "input's kind).", None)
    model_base: Optional[Path] = opt(None, "Base model GGUF, for names, shapes and head counts the input lacks.",
                                     None)


@dataclass
class PlotOptions:
    """`llamatune plot`."""
    metrics: Optional[Path] = opt(None, "Metrics log written by training (metrics.jsonl).", None, argument=True,
                                  required=True)
    output: Optional[Path] = opt(None, "PNG to write (default: the metrics file with .png in place of its "
                                 "extension).", None, flags=("-o",))
    smooth: float = opt(0.9, "Weight of the moving average drawn over the training loss, in [0, 1) (0: no "
                        "smoothing).", None)
    log_y: bool = opt(False, "Logarithmic loss axis.", None, switch=True)
    title: Optional[str] = opt(None, "Plot title (default: the metrics file's name).", None)


@dataclass
class QuickstartOptions:
    """`llamatune quickstart`."""
    workdir: Path = opt(Path("llamatune-quickstart"), "Where the demo writes its files.", None)


@dataclass
class PreviewOptions:
    """`llamatune preview-data`'s own options; its data options are finetune's
    (PREVIEW_FINETUNE_OPTIONS), declared once in FinetuneOptions."""
    n: int = opt(3, "Number of samples to show.", None, names=("-n",))
    json: bool = opt(False, 'One JSON object per line: {"tokens": [...], "targets": [0|1...]}.', None,
                     names=("--json",), switch=True)


# FinetuneOptions fields that preview-data takes, with its extra spellings and what it requires
PREVIEW_FINETUNE_OPTIONS = {"model_base": dict(flags=("-m", "--model"), required=True),
                            "train_data": dict(required=True), "ctx": {}, "data_format": {}, "chat_template": {},
                            "train_on_prompt": {}, "drop_long": {}, "skip_bad_rows": {}, "method": {},
                            "max_completion_length": {}}


def scaled_adapters(values: list[str]) -> list[tuple[str, float]]:
    """--lora-scaled takes 'FILE:SCALE' (llama.cpp spelling); each scale a finite number."""
    out = []
    for v in values:
        path, sep, scale = v.rpartition(":")
        try:
            out.append((path, float(scale)))
        except ValueError:
            raise LlamatuneError(f"--lora-scaled '{v}': expected FILE:SCALE, e.g. adapter.gguf:0.5") from None
        check_number(f"--lora-scaled {path}: scale", out[-1][1])
    return out
