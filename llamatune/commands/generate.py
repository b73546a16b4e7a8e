"""`llamatune generate`: text from a prompt, through the KV-cached generation loop of
models/sampling.py, streamed as it is generated."""
from __future__ import annotations

from typing import Callable, Iterator

from ..errors import LlamatuneError
from ..models.infer import Runner
from ..models.sampling import generate_ids
from ..options import SamplingOptions

D = SamplingOptions            # the defaults, declared once (llamatune/options/)


def generate(runner: Runner, prompt: str, n_predict: int, temp: float = D.temp, top_k: int = D.top_k,
             top_p: float = D.top_p, seed: int = D.seed, n_ctx: int | None = None,
             stop_at_eos: bool = True) -> Iterator[int]:
    """Yield generated token ids (the prompt is not echoed). `n_predict` -1 generates
    until EOS or until the context is full. The arguments are range-checked as
    generate's flags are (SamplingOptions.check)."""
    SamplingOptions(n_predict, temp, top_k, top_p, seed, n_ctx).check()
    ids = runner.model.tokenizer.encode(prompt, add_special=True)
    if not ids:
        raise LlamatuneError("prompt is empty (and the vocabulary adds no BOS token)")
    stop = {runner.model.tokenizer.eos_id} if stop_at_eos else set()
    return generate_ids(runner, ids, n_predict, temp, top_k, top_p, seed, n_ctx, stop)


def stream_text(runner: Runner, prompt: str, token_ids: Iterator[int], write: Callable[[str], None]) -> list[int]:
    """Write the text of a token stream as it arrives. Each step decodes prompt +
    tokens so far and writes only what is new: this keeps word-initial spaces
    (which a decoder drops at the start of a text) and waits out multi-token UTF-8."""
    tok = runner.model.tokenizer
    prefix = tok.encode(prompt, add_special=False)
    base = tok.decode(prefix)
    out: list[int] = []
    shown = 0
    for t in token_ids:
        out.append(t)
        text = tok.decode(prefix + out)[len(base):]
        if text.endswith("\ufffd"):     # incomplete UTF-8 sequence: wait for more bytes
            continue
        write(text[shown:])
        shown = len(text)
    text = tok.decode(prefix + out)[len(base):]
    if text.endswith("\ufffd"):         # the stream ended inside a character: its bytes are not text
        text = text[:-1]
    if len(text) > shown:
        write(text[shown:])
    return out
