"""The `llamatune` command: parses options and calls one library function per command.

Nothing heavy is imported at module level (numpy, numba, gguf load inside the
commands), so `llamatune --help` answers at once. A `LlamatuneError` becomes one
line on stderr and exit code 1 (a `UsageError`, as the parser's own errors: 2);
Ctrl-C exits 130.
"""
from __future__ import annotations

import functools
import sys
import time

import typer

from .help import USAGE_EXIT, App, Group

app = App(
    name="llamatune",
    cls=Group,
    help="LoRA-finetune GGUF llama-family models (quantized ones too) on a CPU or an NVIDIA GPU, and hand the result back to llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from llamatune import __version__
        print(f"llamatune {__version__}")
        raise typer.Exit()


@app.callback()
def _top(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """LoRA-finetune GGUF llama-family models (quantized ones too) on a CPU or an NVIDIA GPU, and hand the
    result back to llama.cpp."""


def friendly_errors(fn):
    """Turn user errors into one clear line and a non-zero exit, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from llamatune.errors import LlamatuneError, UsageError
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            print(f"error: {_rank()}{e}", file=sys.stderr)
            _end_job(USAGE_EXIT)
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


def _is_root() -> bool:
    """False on ranks other than 0 of an MPI job of several ranks."""
    from llamatune.train import distributed          # light: imports mpi4py and numpy only when used
    return distributed.current().is_root


def _rank() -> str:
    """'rank R: ' inside an MPI job of several ranks, else ''."""
    from llamatune.train import distributed
    return distributed.error_prefix()


def _end_job(code: int):
    """Exit; inside an MPI job, take the other ranks down too (they would wait for this one)."""
    from llamatune.train import distributed
    distributed.abort_job(code)
    raise typer.Exit(code)


def _tokenize(o) -> None:
    from llamatune.data.samples import read_text
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    text = o.prompt if o.prompt is not None else read_text(o.file)
    tok = Tokenizer.from_gguf(GGUFFile(o.model))
    result = tok.encode(text, add_special=not o.no_bos)
    if o.ids:
        print("[" + ", ".join(str(t) for t in result) + "]")
    else:
        for t in result:
            print(f"{t:6d} -> '{tok.token_to_piece(t, special=True)}'")


def _runner(o, announce: bool = True):
    """The command's runner; its compute dtype (resolved from --compute-dtype) named on stderr."""
    from llamatune.models.runner import runner_for
    runner = runner_for(o)
    if announce:
        _announce(runner)
    return runner


def _announce(runner) -> None:
    from llamatune.console import err
    err.print(f"compute: {runner.policy.why}")


def _perplexity(o) -> None:
    from llamatune.commands.perplexity import perplexity as run_perplexity
    from llamatune.console import out
    from llamatune.data.samples import read_text
    from llamatune.progress import progress_bar
    text = read_text(o.file)
    runner = _runner(o)
    with progress_bar("perplexity") as bar:
        res = run_perplexity(runner, text, o.ctx, o.batch, source=str(o.file),
                             on_window=lambda d, n, p: bar(d, n, f"PPL {p:.4f}"))
    out.print(f"{res.n_tokens} tokens, {res.n_windows} windows of {o.ctx}, {res.n_scored} scored")
    out.print("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res.chunk_ppls)))
    out.print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")


def _generate(o) -> None:
    from llamatune.commands.generate import generate as run_generate, stream_text
    runner = _runner(o)
    sys.stdout.write(o.prompt)
    ids = run_generate(runner, o.prompt, o.n_predict, o.temp, o.top_k, o.top_p, o.seed, o.ctx)
    stream_text(runner, o.prompt, ids, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    sys.stdout.write("\n")


def _export_lora(o) -> None:
    from llamatune.console import notice, out
    from llamatune.commands.export import export_lora as run_export
    report = run_export(o.model_base, o.adapters(), o.output, o.outtype, o)
    types = sorted(set(report.merged.values()))
    out.print(f"merged {report.n_merged} tensors ({', '.join(types) or 'none'}), copied {report.n_copied} unchanged"
              + (f", converted {report.n_converted}" if report.n_converted else "") + f" -> {report.path}")
    if report.survival:
        out.print(report.survival)
    if report.modelfile is not None:
        out.print(f"Ollama: ollama create NAME -f {report.modelfile}")
    for line in report.warnings:                  # last: what the merge lost, and what to do
        notice(f"warning: {line}")


def _convert_checkpoint(o) -> None:
    from llamatune.console import out
    from llamatune.commands.convert import convert
    out.print(convert(o.input, o.output, o.to, o.model_base))


def _quickstart(o) -> None:
    from llamatune.quickstart import run
    run(o.workdir)


def _preview_data(data, o) -> None:
    from llamatune.data.preview import show_preview
    show_preview(data, o.n, o.json)


def _chat(o) -> None:
    from llamatune.commands.chat import run_chat
    runner = _runner(o, announce=False)
    run_chat(runner, o.chat_template, o.prompt, o.system, o.sampling(), started=lambda: _announce(runner))


def _plot(o) -> None:
    from llamatune.console import out
    from llamatune.plot import plot_metrics
    out.print(f"wrote {plot_metrics(o.metrics, o.output or o.metrics.with_suffix('.png'), o.smooth, o.log_y, o.title)}")


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


def _register_commands() -> None:
    """Every command, its options generated from its dataclass in llamatune/options/."""
    from llamatune import options as o
    from .options_cli import add_options_command

    def add(name, cls, run, help, **kw):
        add_options_command(app, name, cls, run, help, friendly_errors, **kw)
    add("finetune", o.FinetuneOptions, _finetune,
        "Train a LoRA adapter on a frozen GGUF base model (quantized bases stay quantized).", preset=True)
    add("train-from-scratch", o.ScratchOptions, _train_from_scratch,
        "Train a new llama model from scratch; writes a GGUF llama.cpp can run.", preset=True)
    add("tokenize", o.TokenizeOptions, _tokenize, "Tokenize text with the model's own vocabulary, like llama-tokenize.")
    add("perplexity", o.PerplexityOptions, _perplexity,
        "Perplexity of a text, with llama-perplexity's protocol (second half of each window scored).")
    add("generate", o.GenerateOptions, _generate,
        "Generate text from a prompt (KV-cached), optionally with LoRA adapters applied.")
    add("export-lora", o.ExportOptions, _export_lora,
        "Merge LoRA adapters into a base model: W' = W + sum s*(alpha/r)*B@A, quant types kept.")
    add("convert-checkpoint", o.ConvertOptions, _convert_checkpoint,
        "Convert between llamatune checkpoints, GGUF adapters, PEFT adapters and llama.cpp's 2023 formats.")
    add("quickstart", o.QuickstartOptions, _quickstart,
        "Run the whole tool on built-in data: no downloads, a few minutes on a laptop CPU.")
    add("preview-data", o.PreviewOptions, _preview_data,
        "Show the first samples as the trainer sees them, trained tokens highlighted.",
        borrowed=(o.FinetuneOptions, o.PREVIEW_FINETUNE_OPTIONS))
    add("chat", o.ChatOptions, _chat,
        "Chat with a model through its chat template: one turn with -p, else an interactive loop.")
    add("plot", o.PlotOptions, _plot,
        "Draw training loss (raw and smoothed) and validation loss against steps (needs matplotlib).")


_register_commands()


def main():  # pragma: no cover - console-script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
