"""`llamatune preview-data`: the first samples of --train-data as the trainer sees them
(rows, preference pairs, or GRPO's prompts as the sampler continues them)."""
from __future__ import annotations

import json

import numpy as np

from ..errors import LlamatuneError
from .datasets import load_dataset, load_pairs, preview
from .prompts import load_prompts


def show_preview(opts, n: int, as_json: bool) -> None:
    """`llamatune preview-data`: the first n samples of --train-data as the trainer sees them,
    as JSON lines {"tokens", "targets"} or as decoded text with the trained parts highlighted.
    With --method dpo or orpo: the first n pairs, each answer with its prompt ("pair" and
    "answer" in the JSON lines)."""
    from ..console import out
    from ..formats.gguf_io import GGUFFile
    from ..models.tokenizer import Tokenizer
    if opts.model_base is None:
        raise LlamatuneError("--model-base is required")
    tok = Tokenizer.from_gguf(GGUFFile(opts.model_base))
    if getattr(opts, "method", "sft") == "grpo":                # prompts, as the sampler continues them
        _show_prompts(opts, tok, n, as_json)
        return
    pairs = getattr(opts, "method", "sft") in ("dpo", "orpo")  # n pairs, chosen then rejected
    samples = load_pairs(opts.train_data, tok, opts) if pairs else load_dataset(opts.train_data, tok, opts)
    for k, (tokens, targets) in enumerate(preview(samples, tok.bos_id, 2 * n if pairs else n)):
        if as_json:
            row = {"tokens": tokens.tolist(), "targets": targets.tolist()}
            print(json.dumps({"pair": k // 2, "answer": ("chosen", "rejected")[k % 2], **row} if pairs else row))
            continue
        if pairs:
            out.rule(f"pair {k // 2 + 1}, {('chosen', 'rejected')[k % 2]}: {len(tokens)} tokens, "
                     f"{int(targets.sum())} trained", style="dim")
            out.print(_marked(tok, tokens, targets))
            continue
        out.rule(f"sample {k + 1}: {len(tokens)} tokens, {int(targets.sum())} trained", style="dim")
        out.print(_marked(tok, tokens, targets))


def _show_prompts(opts, tok, n: int, as_json: bool) -> None:
    """--method grpo: the first n prompts as the model continues them (template applied)."""
    from ..console import out
    samples = load_prompts(opts.train_data, tok, opts)
    for k in range(min(n, len(samples))):
        ids = samples.prompt_ids(k)
        if as_json:
            print(json.dumps({"prompt": k, "tokens": ids}))
            continue
        out.rule(f"prompt {k + 1}: {len(ids)} tokens", style="dim")
        out.print(_marked(tok, np.asarray(ids), np.zeros(len(ids), np.int8)))


def _marked(tok, tokens, targets):
    """Decoded text with the trained tokens in bold green and control tokens dimmed."""
    from rich.text import Text
    text = Text()
    for t, m in zip(tokens.tolist(), targets.tolist()):
        piece = tok.token_to_piece(t, special=True)
        text.append(piece, style="bold green" if m else ("dim" if tok.is_control(t) else ""))
    return text
