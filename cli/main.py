"""The `llamatune` command: parses options and calls one library function per command.

Nothing heavy is imported at module level (numpy, numba, gguf load inside the
commands), so `llamatune --help` answers at once. A `LlamatuneError` becomes one
line on stderr and exit code 1; Ctrl-C exits 130.
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from llamatune.train.plot import SMOOTH   # light: plot.py imports matplotlib only when drawing

from .help import App

app = App(
    name="llamatune",
    help="LoRA-finetune GGUF llama-family models (quantized ones too) on a CPU or an NVIDIA GPU, and hand the result back to llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def friendly_errors(fn):
    """Turn user errors into one clear line and a non-zero exit, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from llamatune.errors import LlamatuneError
        try:
            return fn(*args, **kwargs)
        except LlamatuneError as e:
            print(f"error: {_rank()}{e}", file=sys.stderr)
            _end_job(1)
        except KeyboardInterrupt as e:                 # Interrupted (training) says how to go on
            code = getattr(e, "exit_code", 130)
            if not _is_root():                        # every rank got the signal: rank 0 says where the run
                time.sleep(3)                         # stands, and its abort ends this rank; still here,
            print(f"{_rank()}{'terminated' if code == 143 else 'interrupted'} {e}".rstrip(), file=sys.stderr)
            _end_job(code)                            # rank 0 did not get it, so this rank says it
        except MemoryError:
            print(f"error: {_rank()}out of memory (try --checkpointing layer, a smaller --batch or a smaller --ctx)",
                  file=sys.stderr)
            _end_job(1)
    return wrapper


def _distributed():
    """train/distributed.py when a command loaded it (training), else None."""
    return sys.modules.get("llamatune.train.distributed")


def _is_root() -> bool:
    """False on ranks other than 0 of an MPI job of several ranks."""
    mod = _distributed()
    return mod is None or mod.current().is_root


def _rank() -> str:
    """'rank R: ' inside an MPI job of several ranks (distributed.py), else ''."""
    mod = _distributed()
    return mod.error_prefix() if mod else ""


def _end_job(code: int):
    """Exit; inside an MPI job, take the other ranks down too (they would wait for this one)."""
    mod = _distributed()
    if mod:
        mod.abort_job(code)
    raise typer.Exit(code)


def read_text(path: Path) -> str:
    from llamatune.train.data import read_text as read
    return read(path)


def parse_scaled(values: List[str]) -> list[tuple[str, float]]:
    """--lora-scaled takes 'FILE:SCALE' (llama.cpp spelling) or 'FILE SCALE'."""
    from llamatune.errors import LlamatuneError
    from llamatune.options import check_number
    out = []
    for v in values:
        path, sep, scale = v.rpartition(":")
        try:
            out.append((path, float(scale)))
        except ValueError:
            raise LlamatuneError(f"--lora-scaled '{v}': expected FILE:SCALE, e.g. adapter.gguf:0.5") from None
        check_number(f"--lora-scaled {path}: scale", out[-1][1])
    return out


def make_runner(model_path: Path, lora: List[Path], lora_scaled: List[str], device: str = "cpu",
                allow_nonfinite: bool = False):
    from llamatune.backend import get_backend
    from llamatune.models.model import Model
    from llamatune.formats.tensors import NonFiniteError
    from llamatune.models.infer import Runner
    specs = [(str(p), 1.0) for p in lora] + parse_scaled(lora_scaled)      # checked before anything loads
    backend = get_backend(device)
    try:
        model = Model(model_path, allow_nonfinite)
        adapters = None
        if specs:
            from llamatune.formats.adapter import load_runtime_adapters
            adapters = load_runtime_adapters(model, specs, allow_nonfinite)
    except NonFiniteError as e:
        raise NonFiniteError(f"{e} (--allow-nonfinite runs anyway)") from None
    return Runner(model, adapters, backend)


LORA_HELP = "LoRA adapter (GGUF) applied at run time with scale 1; repeatable."
LORA_SCALED_HELP = "LoRA adapter with a user scale, as FILE:SCALE; repeatable."
DEVICE_HELP = "cpu, cuda or auto (cuda when a GPU is visible)."
NONFINITE_HELP = "Run even when weights hold inf or nan (a notice names them; results may be nan)."
# options shared by the generating commands (generate, chat)
TEMP = typer.Option(0.8, "--temp", help="Temperature; 0 = greedy.")
TOP_K = typer.Option(40, "--top-k", help="Keep the k most likely tokens (0 = all).")
TOP_P = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold (1 = off).")
SEED = typer.Option(0, "--seed", help="Random seed.")
CTX = typer.Option(None, "-c", "--ctx", help="Context size (default: the model's).")
LORA = typer.Option([], "--lora", help=LORA_HELP)
LORA_SCALED = typer.Option([], "--lora-scaled", help=LORA_SCALED_HELP)
DEVICE = typer.Option("cpu", "--device", help=DEVICE_HELP)


@app.command()
@friendly_errors
def tokenize(
    model: Path = typer.Option(..., "-m", "--model", help="GGUF model or vocab-only GGUF."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Text to tokenize."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Tokenize this file's exact text."),
    ids: bool = typer.Option(False, "--ids", help="Print only the ids, as one list: [1, 15043, 3186]."),
    no_bos: bool = typer.Option(False, "--no-bos", help="Add no special tokens (BOS/EOS)."),
):
    """Tokenize text with the model's own vocabulary, like llama-tokenize."""
    from llamatune.errors import LlamatuneError
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    if (prompt is None) == (file is None):
        raise LlamatuneError("give exactly one of -p/--prompt and -f/--file")
    text = prompt if prompt is not None else read_text(file)
    tok = Tokenizer.from_gguf(GGUFFile(model))
    result = tok.encode(text, add_special=not no_bos)
    if ids:
        print("[" + ", ".join(str(t) for t in result) + "]")
    else:
        for t in result:
            print(f"{t:6d} -> '{tok.token_to_piece(t, special=True)}'")


@app.command()
@friendly_errors
def perplexity(
    model: Path = typer.Option(..., "-m", "--model", help="GGUF model."),
    file: Path = typer.Option(..., "-f", "--file", help="Text file to score."),
    ctx: int = typer.Option(512, "-c", "--ctx", help="Window size in tokens."),
    batch: int = typer.Option(2048, "-b", "--batch", help="Tokens per forward pass (whole windows are batched)."),
    lora: List[Path] = typer.Option([], "--lora", help=LORA_HELP),
    lora_scaled: List[str] = typer.Option([], "--lora-scaled", help=LORA_SCALED_HELP),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=NONFINITE_HELP),
):
    """Perplexity of a text, with llama-perplexity's protocol (second half of each window scored)."""
    from llamatune.console import out
    from llamatune.options import check_number
    from llamatune.commands.perplexity import perplexity as run_perplexity
    from llamatune.progress import progress_bar
    check_number("-b/--batch", batch, 1)
    text = read_text(file)
    runner = make_runner(model, lora, lora_scaled, device, allow_nonfinite)
    with progress_bar("perplexity") as bar:
        res = run_perplexity(runner, text, ctx, batch, source=str(file),
                             on_window=lambda d, n, p: bar(d, n, f"PPL {p:.4f}"))
    out.print(f"{res.n_tokens} tokens, {res.n_windows} windows of {ctx}, {res.n_scored} scored")
    out.print("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res.chunk_ppls)))
    out.print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")


@app.command()
@friendly_errors
def generate(
    model: Path = typer.Option(..., "-m", "--model", help="GGUF model."),
    prompt: str = typer.Option(..., "-p", "--prompt", help="Prompt text."),
    n_predict: int = typer.Option(64, "-n", "--n-predict",
                                  help="Tokens to generate (-1: until EOS or the context is full)."),
    temp: float = TEMP,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    seed: int = SEED,
    ctx: Optional[int] = CTX,
    lora: List[Path] = LORA,
    lora_scaled: List[str] = LORA_SCALED,
    device: str = DEVICE,
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help=NONFINITE_HELP),
):
    """Generate text from a prompt (KV-cached), optionally with LoRA adapters applied."""
    from llamatune.commands.generate import check_sampling, generate as run_generate, stream_text
    check_sampling(n_predict, temp, top_k, top_p, seed, ctx)
    runner = make_runner(model, lora, lora_scaled, device, allow_nonfinite)
    sys.stdout.write(prompt)
    ids = run_generate(runner, prompt, n_predict, temp, top_k, top_p, seed, ctx)
    stream_text(runner, prompt, ids, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    sys.stdout.write("\n")


def _merge_help(name: str) -> str:
    from dataclasses import fields
    from llamatune.options import MergeOptions
    f = next(f for f in fields(MergeOptions) if f.name == name)
    return f"{f.metadata['help']} [default: {f.default if f.default is not None else 'none'}]"


@app.command("export-lora")
@friendly_errors
def export_lora(
    model_base: Path = typer.Option(..., "-m", "--model-base", help="Base model GGUF."),
    lora: List[Path] = typer.Option([], "--lora", help="Adapter to merge with scale 1; repeatable."),
    lora_scaled: List[str] = typer.Option([], "--lora-scaled", help="Adapter with a user scale, FILE:SCALE; repeatable."),
    output: Path = typer.Option(..., "-o", "--output", help="Merged model GGUF to write."),
    outtype: str = typer.Option("same", "--outtype", help="same (keep each tensor's type, quantized ones "
                                "re-quantized), or f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k..q6_k."),
    merge_method: Optional[str] = typer.Option(None, "--merge-method", help=_merge_help("merge_method")),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help=_merge_help("imatrix")),
    calibration_data: Optional[Path] = typer.Option(None, "--calibration-data", help=_merge_help("calibration_data")),
    calibration_ctx: Optional[int] = typer.Option(None, "--calibration-ctx", help=_merge_help("calibration_ctx")),
    calibration_chunks: Optional[int] = typer.Option(None, "--calibration-chunks", help=_merge_help("calibration_chunks")),
    calibration_memory: Optional[int] = typer.Option(None, "--calibration-memory", help=_merge_help("calibration_memory")),
    imatrix_out: Optional[Path] = typer.Option(None, "--imatrix-out", help=_merge_help("imatrix_out")),
    ollama: Optional[Path] = typer.Option(None, "--ollama", help=_merge_help("ollama")),
):
    """Merge LoRA adapters into a base model: W' = W + sum s*(alpha/r)*B@A, quant types kept."""
    from llamatune.console import out
    from llamatune.commands.export import export_lora as run_export
    from llamatune.options import MergeOptions
    specs = [(Path(p), 1.0) for p in lora] + [(Path(p), s) for p, s in parse_scaled(lora_scaled)]
    given = dict(merge_method=merge_method, imatrix=imatrix, calibration_data=calibration_data,
                 calibration_ctx=calibration_ctx, calibration_chunks=calibration_chunks,
                 calibration_memory=calibration_memory, imatrix_out=imatrix_out, ollama=ollama)
    merge = MergeOptions(**{k: v for k, v in given.items() if v is not None})
    report = run_export(model_base, specs, output, outtype, merge)
    types = sorted(set(report.merged.values()))
    out.print(f"merged {report.n_merged} tensors ({', '.join(types) or 'none'}), copied {report.n_copied} unchanged"
              + (f", converted {report.n_converted}" if report.n_converted else "") + f" -> {report.path}")
    if report.modelfile is not None:
        out.print(f"Ollama: ollama create NAME -f {report.modelfile}")


@app.command("convert-checkpoint")
@friendly_errors
def convert_checkpoint(
    input: Path = typer.Argument(..., help="Checkpoint, adapter, PEFT directory, 2023 checkpoint or ggla .bin."),
    output: Path = typer.Option(..., "-o", "--output", help="File or directory to write."),
    to: Optional[str] = typer.Option(None, "--to", help="gguf-adapter, peft, checkpoint or model "
                                     "(default: the usual target for the input's kind)."),
    model_base: Optional[Path] = typer.Option(None, "--model-base", help="Base model GGUF, for names, shapes "
                                              "and head counts the input lacks."),
):
    """Convert between llamatune checkpoints, GGUF adapters, PEFT adapters and llama.cpp's 2023 formats."""
    from llamatune.console import out
    from llamatune.commands.convert import convert
    out.print(convert(input, output, to, model_base))


@app.command()
@friendly_errors
def quickstart(
    workdir: Path = typer.Option(Path("llamatune-quickstart"), "--workdir", help="Where the demo writes its files."),
):
    """Run the whole tool on built-in data: no downloads, a few minutes on a laptop CPU."""
    from llamatune.commands.quickstart import run
    run(workdir)


@app.command("preview-data")
@friendly_errors
def preview_data(
    model_base: Path = typer.Option(..., "-m", "--model-base", "--model", help="Model GGUF whose tokenizer and chat template are used."),
    train_data: Path = typer.Option(..., "--train-data", help="Data file (raw text, JSONL or JSON rows)."),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx", help="Context length (default: finetune's)."),
    n: int = typer.Option(3, "-n", help="Number of samples to show."),
    as_json: bool = typer.Option(False, "--json", help='One JSON object per line: {"tokens": [...], "targets": [0|1...]}.'),
    data_format: Optional[str] = typer.Option(None, "--data-format", help="text, chat, completion or auto."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="Jinja file or built-in name."),
    train_on_prompt: Optional[bool] = typer.Option(None, "--train-on-prompt", help="Targets on every token."),
    drop_long: Optional[bool] = typer.Option(None, "--drop-long", help="Drop samples longer than --ctx."),
    skip_bad_rows: Optional[bool] = typer.Option(None, "--skip-bad-rows", help="Skip malformed rows."),
):
    """Show the first samples as the trainer sees them, trained tokens highlighted."""
    from llamatune.train.datasets import show_preview
    from llamatune.options import FinetuneOptions, build_options
    given = dict(model_base=model_base, train_data=train_data, ctx=ctx, data_format=data_format,
                 chat_template=chat_template, train_on_prompt=train_on_prompt, drop_long=drop_long,
                 skip_bad_rows=skip_bad_rows)
    show_preview(build_options(FinetuneOptions, given), n, as_json)


@app.command()
@friendly_errors
def chat(
    model: Path = typer.Option(..., "-m", "--model", help="GGUF model with a chat template (or use --chat-template)."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Answer this one message and exit."),
    system: Optional[str] = typer.Option(None, "-s", "--system", help="System message."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="Jinja file or built-in name "
                                                "(chatml, llama3, gemma, phi3, mistral)."),
    n_predict: int = typer.Option(256, "-n", "--n-predict", help="Most tokens per answer."),
    temp: float = TEMP,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    seed: int = SEED,
    ctx: Optional[int] = CTX,
    lora: List[Path] = LORA,
    lora_scaled: List[str] = LORA_SCALED,
    device: str = DEVICE,
):
    """Chat with a model through its chat template: one turn with -p, else an interactive loop."""
    from llamatune.commands.chat import Sampling, run_chat
    runner = make_runner(model, lora, lora_scaled, device)
    run_chat(runner, chat_template, prompt, system, Sampling(n_predict, temp, top_k, top_p, seed, ctx))


@app.command()
@friendly_errors
def plot(
    metrics: Path = typer.Argument(..., help="Metrics log written by training (metrics.jsonl)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG to write (default: the metrics "
                                          "file with .png in place of its extension)."),
    smooth: float = typer.Option(SMOOTH, "--smooth", help="Weight of the moving average drawn over the training "
                                 "loss, in [0, 1) (0: no smoothing)."),
    log_y: bool = typer.Option(False, "--log-y", help="Logarithmic loss axis."),
    title: Optional[str] = typer.Option(None, "--title", help="Plot title (default: the metrics file's name)."),
):
    """Draw training loss (raw and smoothed) and validation loss against steps (needs matplotlib)."""
    from llamatune.console import out
    from llamatune.train.plot import plot_metrics
    out.print(f"wrote {plot_metrics(metrics, output or metrics.with_suffix('.png'), smooth, log_y, title)}")


def _report(name: str, res) -> None:
    from llamatune.console import out
    if res.losses:
        k = max(1, min(10, len(res.losses) // 5))       # single steps are noisy: average k at each end
        first, last = sum(res.losses[:k]) / k, sum(res.losses[-k:]) / k
        steady = f", {res.steady_tokens_per_second:,.0f} after the first step" if res.steady_tokens_per_second else ""
        n = len(res.losses)
        span = "first and last step" if k == 1 else f"mean of the first and last {k} steps"
        out.print(f"{name}: {n} step{'s' * (n != 1)} in {res.seconds:.1f} s ({res.tokens_per_second:,.0f} tokens/s{steady}), "
                  f"loss ({span}) {first:.4f} -> {last:.4f}")
    v = res.state.validation
    if v is not None and v.last_loss is not None:
        out.print(f"validation loss {v.last_loss:.4f} at step {v.last_step}, best {v.best_loss:.4f} at step "
                  f"{v.best_step}")
    for p in res.files:
        out.print(f"  wrote {p}")


def _finetune(opts) -> None:
    from llamatune.commands.finetune import finetune
    _report("finetune", finetune(opts))


def _train_from_scratch(opts) -> None:
    from llamatune.commands.scratch import train_from_scratch
    _report("train-from-scratch", train_from_scratch(opts))


def _register_training_commands() -> None:
    from llamatune.options import FinetuneOptions, ScratchOptions
    from .options_cli import add_options_command
    add_options_command(app, "finetune", FinetuneOptions, _finetune,
                        "Train a LoRA adapter on a frozen GGUF base model (quantized bases stay quantized).",
                        friendly_errors)
    add_options_command(app, "train-from-scratch", ScratchOptions, _train_from_scratch,
                        "Train a new llama model from scratch; writes a GGUF llama.cpp can run.",
                        friendly_errors)


_register_training_commands()


def main():  # pragma: no cover - console-script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
