"""`llamatune quickstart`, the no-download tour: every command of llamatune on built-in
data. It runs the other commands, so it sits above them (the one module besides the
command line that imports commands).

Everything comes from the package itself: a public-domain Shakespeare sample
(`llamatune/assets/shakespeare-sample.txt`). The tour
  1. trains a small llama from scratch on the first part of it (a SentencePiece
     vocabulary trained on the text, with ChatML's <|im_start|> and <|im_end|> as control
     tokens for step 6; the model written as Q8_0 GGUF),
  2. finetunes a LoRA adapter on the quantized model with the last part, printing
     the loss as it falls,
  3. generates text with the adapter applied at run time,
  4. merges the adapter into a Q8_0 model with export-lora, and
  5. compares perplexities on the finetuning text: base, base + adapter, merged, and
  6. finetunes a chat adapter on a tiny built-in conversation set
     (`llamatune/assets/chat-sample.jsonl`, answers in a Shakespearean voice) with the
     built-in ChatML template and loss on the answers only, then asks it a question.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .console import out


def sample_text() -> str:
    return resources.files("llamatune").joinpath("assets/shakespeare-sample.txt").read_text(encoding="utf-8")


def chat_sample() -> Path:
    return Path(str(resources.files("llamatune").joinpath("assets/chat-sample.jsonl")))


def chat_leg(workdir: Path, base: Path, ctx: int = 128, chat_ctx: int | None = None) -> None:
    """Step 6: conversations, template, answers-only loss, packed rows, one chat turn."""
    import sys

    from .commands.chat import Chat, Sampling
    from .commands.finetune import finetune
    from .data.datasets import load_dataset, preview
    from .models.chat_template import load_template
    from .models.runner import make_runner
    from .options import FinetuneOptions

    opts = FinetuneOptions(model_base=base, train_data=chat_sample(), chat_template="chatml", ctx=ctx, batch=4,
                           pack=True, lora_r=8, adam_iter=40, warmup=5, cos_decay_steps=40, adam_alpha=3e-3,
                           save_every=0, checkpoint_out=workdir / "chat-chk-ITERATION.gguf",
                           lora_out=workdir / "chat-adapter-ITERATION.gguf",
                           metrics_out=workdir / "chat-metrics.jsonl", overwrite=True)
    runner = make_runner(base)
    tok = runner.model.tokenizer
    tokens, targets = preview(load_dataset(opts.train_data, tok, opts), tok.bos_id, 1)[0]
    trained = tok.decode([t for t, m in zip(tokens.tolist(), targets.tolist()) if m])
    out.print(f"\n[bold]6. chat finetune[/bold] on {opts.train_data.name} (24 conversations, ChatML, --pack); "
              f"trained part of the first: {trained!r}")
    res = finetune(opts)
    out.print(f"   loss {res.losses[0]:.3f} -> {res.losses[-1]:.3f} in {len(res.losses)} steps")
    adapter = workdir / "chat-adapter-LATEST.gguf"
    runner = make_runner(base, [(str(adapter), 1.0)])
    chat = Chat(runner, load_template(tok, "chatml"), sampling=Sampling(n_predict=30, temp=0, ctx=chat_ctx))
    question = "What is the weather like today?"
    out.print(f"   llamatune chat -m {base} --lora {adapter} --chat-template chatml -p {question!r}")
    sys.stdout.write("   ")
    chat.say(question, sys.stdout.write)
    sys.stdout.write("\n")


def run(workdir: Path) -> None:
    from .locks import hold
    from .outputs import Out, check_paths
    work = Out("--workdir", workdir, is_dir=True)
    check_paths([], [work])
    with hold([work], "quickstart"):            # its commands lock their own files inside too
        _tour(workdir)


def _split_sample(workdir: Path) -> tuple[str, int]:
    """The sample text and where its last 25 % begin (at a paragraph): the first part
    written for train-from-scratch, the rest for the finetune."""
    from .formats.gguf_io import write_error
    text = sample_text()
    cut = int(len(text) * 0.75)
    cut = text.rindex("\n\n", 0, cut) + 2
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "base-text.txt").write_text(text[:cut], encoding="utf-8")
        (workdir / "finetune-text.txt").write_text(text[cut:], encoding="utf-8")
    except OSError as e:
        raise write_error(workdir, e) from None
    return text, cut


def _tour(workdir: Path) -> None:
    """run once the work directory is checked and locked."""
    import sys

    from .models.runner import make_runner
    from .options import FinetuneOptions, ScratchOptions
    from .commands.export import export_lora
    from .commands.finetune import finetune
    from .commands.generate import generate, stream_text
    from .commands.perplexity import perplexity
    from .commands.scratch import train_from_scratch

    text, cut = _split_sample(workdir)
    out.print("[bold]1. train-from-scratch[/bold]: a 4-layer llama on the first 75 % of the sample")
    base_opts = ScratchOptions(train_data=workdir / "base-text.txt", vocab_size=2048,
                               special_tokens="<|im_start|>,<|im_end|>", embd=128, head=4, head_kv=2,
                               layer=4, ctx=128, batch=8, adam_iter=150, warmup=10, cos_decay_steps=150,
                               adam_alpha=3e-3, save_every=0, outtype="q8_0",
                               checkpoint_out=workdir / "scratch-chk-ITERATION.gguf",
                               model_out=workdir / "base-ITERATION.Q8_0.gguf",
                               metrics_out=workdir / "scratch-metrics.jsonl", overwrite=True)
    train_from_scratch(base_opts)
    base = workdir / "base-LATEST.Q8_0.gguf"

    out.print(f"\n[bold]2. finetune[/bold]: LoRA r=8 on the quantized {base.name}, last 25 % of the sample")
    ft = finetune(FinetuneOptions(model_base=base, train_data=workdir / "finetune-text.txt", ctx=128, batch=8,
                                  lora_r=8, adam_iter=60, warmup=5, cos_decay_steps=60, adam_alpha=3e-3,
                                  save_every=20, checkpoint_out=workdir / "chk-ITERATION.gguf",
                                  lora_out=workdir / "adapter-ITERATION.gguf",
                                  metrics_out=workdir / "finetune-metrics.jsonl", overwrite=True))
    adapter = workdir / "adapter-LATEST.gguf"
    out.print(f"   loss {ft.losses[0]:.3f} -> {ft.losses[-1]:.3f} in {len(ft.losses)} steps "
              f"({ft.tokens_per_second:,.0f} tokens/s)")

    tuned = make_runner(base, [(str(adapter), 1.0)])
    prompt = "HELENA."
    out.print(f"\n[bold]3. generate[/bold] with the adapter (llamatune generate -m {base} --lora {adapter}):")
    sys.stdout.write(prompt)
    stream_text(tuned, prompt, generate(tuned, prompt, 40, temp=0.7, seed=1), sys.stdout.write)
    sys.stdout.write("\n")

    merged = workdir / "merged.Q8_0.gguf"
    report = export_lora(base, [(adapter, 1.0)], merged)
    out.print(f"\n[bold]4. export-lora[/bold]: merged {report.n_merged} tensors, kept as "
              f"{', '.join(sorted(set(report.merged.values())))} -> {merged.name}")

    out.print("\n[bold]5. perplexity[/bold] on the finetuning text (c=64):")
    eval_text = text[cut:]
    for label, runner in (("base", make_runner(base)), ("base + adapter", tuned), ("merged", make_runner(merged))):
        res = perplexity(runner, eval_text, 64, 512, source="finetune text")
        out.print(f"   {label:15} PPL = {res.ppl:8.3f} +/- {res.ppl_err:.3f}")
    chat_leg(workdir, base)
    out.print(f"\nFiles are in {workdir}/. Try: llamatune generate -m {base} --lora {adapter} -p 'HELENA.'")
