"""Tokenizer built only from a GGUF's `tokenizer.ggml.*` metadata, giving llama.cpp's token ids.

It mirrors llama.cpp's src/llama-vocab.cpp (`llama_vocab::impl::load`, `tokenize`,
`tokenizer_st_partition`, `token_to_piece`, `detokenize`):

* special-token partition: before any model runs, the text is split on the texts of
  user-defined tokens (always) and of control/unknown tokens (only with
  `parse_special=True`), longest token first, with llama.cpp's per-model lstrip/rstrip;
* `tokenizer.ggml.model == "llama"` (SPM): each text fragment gets a " " prefix when it
  follows a special token or starts the text (add_space_prefix), spaces become U+2581,
  and llama.cpp's score-ordered bigram merging runs.  That algorithm is SentencePiece's
  BPE, so we run the `sentencepiece` library on a ModelProto serialized here by hand,
  in which every token is a NORMAL piece (llama.cpp merges into any token text, whatever
  its type) and byte fallback is done afterwards, as llama.cpp's resegment() does;
* `tokenizer.ggml.model == "gpt2"` (byte-level BPE): the `tokenizers` library with
  llama.cpp's pre-tokenizer regexes for `tokenizer.ggml.pre`, ranks from
  `tokenizer.ggml.merges` and llama.cpp's `ignore_merges` flag;
* decoding is llama.cpp's `llama_detokenize(remove_special=false, unparse_special=false)`:
  control/unknown tokens are skipped, the SPM dummy-prefix space is dropped from the
  first piece only, and `clean_spaces` vocabularies get llama.cpp's three clean-up passes.

Known corner case where llama.cpp can differ: BPE merges whose result is not a token
(llama.cpp merges, then falls back to bytes; such merges are dropped here).
"""
from __future__ import annotations

import re
import struct
import warnings
from typing import Any

from ..errors import LlamatuneError
from .pretokenizers import PRE_TOKENIZERS, PreTokenizer

# GGUF token types (same numbering as sentencepiece's ModelProto.SentencePiece.Type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL = {_CONTROL, _UNKNOWN}             # skipped when decoding, split only with parse_special
_ASCII_SPACE = " \t\n\v\f\r"                # C isspace(), used by lstrip/rstrip

# Token texts llama.cpp's load() marks CONTROL whatever their GGUF type (EOT/EOM/FIM/EOG detection)
_CONTROL_TEXTS = frozenset("""<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|>
    <EOT> _<EOT> [EOT] [EOS] <｜end▁of▁sentence｜> <end_of_utterance> <|eom_id|> <|return|> <|call|>
    <|flush|> <|calls|> </s> <eos> <turn|> <|tool_response> [e~[
    <|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|> <|prefix|>
    <|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> <|suffix|>
    <|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> <|middle|>
    <|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD] <|fim_repo|> <|repo_name|> <fim-repo> <REPO>
    <reponame> <|file_sep|>""".split())
# Texts llama.cpp's load() adds to special_eog_ids (when the token is a control token)
_EOG_TEXTS = frozenset("""<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <|eom_id|>
    <EOT> _<EOT> <｜end▁of▁sentence｜> <end_of_utterance> <|return|> <|call|> <turn|>""".split())
_GPT_OSS_USER_DEFINED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])

# GPT-2's printable character -> byte map of byte-level BPE vocabularies (printable bytes
# stand for themselves, the other 68 bytes for U+0100, U+0101, ... in byte order)
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_DECODER = {chr(b): b for b in _PRINTABLE}
_BYTE_DECODER |= {chr(256 + k): b for k, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}


# ---- a SentencePiece ModelProto, serialized by hand (protobuf wire format) ----
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _spm_model_proto(pieces: list[tuple[str, float, int]]) -> bytes:
    """ModelProto{pieces=1{piece=1, score=2, type=3}, trainer_spec=2, normalizer_spec=3}."""
    out = bytearray()
    for text, score, ptype in pieces:
        raw = text.encode("utf-8")
        body = b"\x0a" + _varint(len(raw)) + raw + b"\x15" + struct.pack("<f", score) + b"\x18" + _varint(ptype)
        out += b"\x0a" + _varint(len(body)) + body
    # TrainerSpec: model_type=BPE(2), vocab_size, unk_id = the last piece, no bos/eos/pad
    trainer = (b"\x18\x02" + b"\x20" + _varint(len(pieces)) + _varint(40 << 3) + _varint(len(pieces) - 1)
               + b"".join(_varint(num << 3) + _varint(-1) for num in (41, 42, 43)))
    # NormalizerSpec: name="identity", add_dummy_prefix=false (added per fragment, like
    # llama.cpp), remove_extra_whitespaces=false, escape_whitespaces=true
    normalizer = _len_field(1, b"identity") + b"\x18\x00" + b"\x20\x00" + b"\x28\x01"
    return bytes(out + _len_field(2, trainer) + _len_field(3, normalizer))


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


def _excerpt(text: str, at: int, width: int = 20) -> str:
    """The characters around text[at], quoted, for an error line that stays one short line."""
    lo, hi = max(0, at - width), min(len(text), at + width + 1)
    return ("..." if lo else "") + repr(text[lo:hi]) + ("..." if hi < len(text) else "")


class Tokenizer:
    """llama.cpp-exact tokenizer for GGUF "llama" (SentencePiece) and "gpt2" (byte-level BPE) vocabularies."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool

    @classmethod
    def from_gguf(cls, f: Any) -> "Tokenizer":
        """Build from a `GGUFFile` (anything with `.path` and `.get(key, default)`)."""
        self = cls.__new__(cls)
        self._path = f.path
        self._lstrip, self._rstrip = set(), set()   # tokens whose text eats whitespace around it
        model = f.get("tokenizer.ggml.model")
        if model is None:
            self._fail("no tokenizer metadata (missing 'tokenizer.ggml.model')")
        if model not in ("llama", "gpt2", "gemma4"):
            self._fail(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: 'llama' "
                       "(SentencePiece), 'gpt2' (byte-level BPE) and 'gemma4' (BPE on SentencePiece-style pieces)")
        self._spm = model == "llama"
        scores = self._load_vocab(f)
        pre, setting = self._load_settings(f, model)
        self._load_specials(f, pre)
        if self._spm:
            self._build_spm(scores)
        else:
            self._build_bpe(f, setting)
        return self

    # ---- construction helpers ----
    def _load_vocab(self, f: Any) -> list:
        """The tokens, their types and the control set (llama.cpp's load()); returns the scores."""
        tokens = self._array(f, "tokenizer.ggml.tokens", str, required=True)
        n = self.n_vocab = len(tokens)
        scores = self._array(f, "tokenizer.ggml.scores", (int, float)) or [0.0] * n
        types = self._array(f, "tokenizer.ggml.token_type", int) or [_NORMAL] * n
        if len(scores) < n or len(types) < n:
            self._fail(f"'tokenizer.ggml.scores'/'token_type' have fewer entries than the {n} tokens")
        # load(): empty texts get a placeholder, duplicates are an error
        self._texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._ids = {t: i for i, t in enumerate(self._texts)}
        if len(self._ids) != n:
            i, dup = next((i, t) for i, t in enumerate(self._texts) if self._ids[t] != i)
            self._fail(f"duplicate token {dup!r} in vocabulary (ids {i} and {self._texts.index(dup, i + 1)})")
        self._types = [t if 1 <= t <= 6 else 0 for t in types[:n]]
        self._control = {i for i, t in enumerate(self._types) if t in _SPECIAL}
        self._control |= {self._ids[t] for t in _CONTROL_TEXTS & self._ids.keys()}  # auto-detected EOG/FIM
        ids = self._ids
        user = _GPT_OSS_USER_DEFINED & ids.keys()
        has = ids.__contains__
        if has("<|end|>") and (has("<|call|>") or has("<|calls|>")) and (has("<|return|>") or has("<|flush|>")):
            user.add("<|end|>")                              # o200k_harmony / solar-open: not EOG
        for text in user:
            self._control.discard(ids[text])
            self._types[ids[text]] = _USER_DEFINED
        if "<|tool_response>" in ids and "</s>" in ids:     # gemma4 / paddleocr: </s> is a normal token
            self._control.discard(ids["</s>"])
            self._types[ids["</s>"]] = _NORMAL
        return scores

    def _load_settings(self, f: Any, model: str) -> tuple[str | None, PreTokenizer]:
        """BOS/EOS, their add flags, spaces and the pre-tokenizer: load()'s defaults for the
        model, then the GGUF keys. Returns (tokenizer.ggml.pre as used, its setting)."""
        # defaults of load(), then overridden by the GGUF keys
        pre = f.get("tokenizer.ggml.pre")
        setting = PreTokenizer([])
        self._spm_style = False     # BPE on U+2581-escaped raw UTF-8 (gemma4), not GPT-2 byte-level
        if self._spm:
            bos, eos, self.add_bos, self.add_eos, self._clean_spaces = 1, 2, True, False, False
        else:
            bos = eos = 11
            if model == "gemma4":   # load() ignores tokenizer.ggml.pre and has no default special ids
                pre, bos, eos = "gemma4", None, None
            elif pre is None:
                warnings.warn(f"{self._path}: no 'tokenizer.ggml.pre', using llama.cpp's 'default' "
                              "pre-tokenizer (generation quality may degrade)")
                pre = "default"
            elif pre in ("glm4", "glm5", "chatglm-bpe"):
                bos = None
            if pre not in PRE_TOKENIZERS:
                self._fail(f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {', '.join(sorted(PRE_TOKENIZERS))}")
            setting = PRE_TOKENIZERS[pre]
            self._clean_spaces, self.add_bos, self._spm_style = setting.clean_spaces, setting.add_bos, setting.spm_style
            self.add_eos = False
        # read for every model: detokenize() drops one leading space of the first piece when set
        self._add_space_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", self._spm))
        self.bos_id = self._special_id(f, "bos", bos)
        self.eos_id = self._special_id(f, "eos", eos)
        template = f.get("tokenizer.chat_template")
        self.chat_template = template if isinstance(template, str) and template.strip() else None
        self.unk_id = self._special_id(f, "unknown", None)
        self.pad_id = self._special_id(f, "padding", None)
        self.add_bos = bool(f.get("tokenizer.ggml.add_bos_token", self.add_bos)) or setting.gemma4
        self.add_eos = bool(f.get("tokenizer.ggml.add_eos_token", self.add_eos))
        for flag, tid, name in ((self.add_bos, self.bos_id, "bos"), (self.add_eos, self.eos_id, "eos")):
            if flag and tid is None:
                self._fail(f"tokenizer.ggml.add_{name}_token is true but there is no {name} token id")
        return pre, setting

    def _load_specials(self, f: Any, pre: str | None) -> None:
        """The special tokens' matching order, lstrip/rstrip sets and end-of-generation ids."""
        ids = self._ids
        # special-token cache: longest text (in bytes) first; phi-3 rstrip / jina lstrip attributes
        special = [i for i, t in enumerate(self._types) if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)
                   or i in self._control]
        special.sort(key=lambda i: -len(self._texts[i].encode("utf-8")))
        self._special_order = special
        self._user_order = [i for i in special if i not in self._control and self._types[i] != _UNKNOWN]
        name = str(f.get("general.name", "")).lower()
        arch = str(f.get("general.architecture", ""))
        if any(s in str(pre or "") for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            self._lstrip = {ids[t] for t in ["<mask>"] if t in ids}
        elif "phi-3" in name or "phi3" in name:
            self._rstrip = set(special) | {ids[t] for t in ["</s>"] if t in ids}
            self._rstrip -= {ids[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in ids}
        elif "modern-bert" in name:
            self._lstrip = {ids[t] for t in ["[MASK]"] if t in ids}

        # end-of-generation tokens (llama.cpp's special_eog_ids): EOS, EOT/EOM, and the
        # auto-detected end-of-turn texts; generation stops at any of them
        self.eog_ids = {i for i in (self.eos_id, self._special_id(f, "eot", None), self._special_id(f, "eom", None))
                        if i is not None}
        self.eog_ids |= {ids[t] for t in _EOG_TEXTS & ids.keys()} & self._control

    def _fail(self, problem: str):
        raise LlamatuneError(f"{self._path}: {problem}")

    def _array(self, f: Any, key: str, kind, required: bool = False) -> list | None:
        value = f.get(key)
        if value is None:
            if required:
                self._fail(f"missing tokenizer metadata key '{key}'")
            return None
        if not isinstance(value, list) or not all(isinstance(v, kind) for v in value) or (required and not value):
            self._fail(f"metadata key '{key}' must be a non-empty array of {getattr(kind, '__name__', 'numbers')}")
        return value

    def _special_id(self, f: Any, name: str, default: int | None) -> int | None:
        if default is not None and default >= self.n_vocab:
            default = None
        value = f.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < self.n_vocab else default

    def _build_spm(self, scores: list[float]) -> None:
        import sentencepiece as spm

        # every token is a NORMAL piece, byte tokens included: llama.cpp merges into any
        # token text.  Byte fallback is done here (sentencepiece's needs all 256 bytes).
        pieces = [(text, float(score), _NORMAL) for text, score in zip(self._texts, scores)]
        unk = "<llamatune-unk>"
        while unk in self._ids:
            unk += "_"
        pieces.append((unk, 0.0, _UNKNOWN))   # sentencepiece needs an unknown piece; id n_vocab
        # llama_vocab::byte_to_token: "<0xXX>", else the byte as a one-character token
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b)) if b < 128 else None)
                          for b in range(256)]
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(_spm_model_proto(pieces))
        except RuntimeError as e:
            self._fail(f"SentencePiece rejected the vocabulary ({e})")

    def _build_bpe(self, f: Any, setting: PreTokenizer) -> None:
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges_raw = self._array(f, "tokenizer.ggml.merges", str, required=True)
        ids, merges, seen = self._ids, [], set()
        for m in merges_raw:
            pos = m.find(" ", 1)
            pair = (m[:pos], m[pos + 1:])
            # the `tokenizers` BPE needs both parts and the result in the vocabulary;
            # llama.cpp keeps the first rank of a repeated pair
            if pos > 0 and pair not in seen and pair[0] in ids and pair[1] in ids and pair[0] + pair[1] in ids:
                seen.add(pair)
                merges.append(pair)
        # SPM-style pieces are raw UTF-8 and fall back to <0xXX> tokens; byte-level ones are
        # GPT-2's printable characters, so every byte is a token
        hf = HFTokenizer(models.BPE(ids, merges, ignore_merges=setting.ignore_merges,
                                    byte_fallback=setting.spm_style))
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in setting.regexes]
        if not setting.spm_style:
            splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
        self._hf = hf
        # gemma4 (llm_tokenizer_bpe_session::tokenize): a run of newlines that is a token is
        # taken whole, without merges
        self._newline_runs = setting.gemma4

    # ---- encoding ----
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: split raw text into text fragments and special token ids."""
        frags: list[str | int] = [text]
        for tid in self._special_order if parse_special else self._user_order:
            tok = self._texts[tid]
            if not any(isinstance(fr, str) and tok in fr for fr in frags):
                continue
            out: list[str | int] = []
            for fr in frags:
                if isinstance(fr, int) or tok not in fr:
                    out.append(fr)
                    continue
                parts = fr.split(tok)
                for k, part in enumerate(parts):
                    if k > 0 and tid in self._rstrip:
                        part = part.lstrip(_ASCII_SPACE)
                    if k < len(parts) - 1 and tid in self._lstrip:
                        part = part.rstrip(_ASCII_SPACE)
                    if part:
                        out.append(part)
                    if k < len(parts) - 1:
                        out.append(tid)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids exactly as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special adds BOS/EOS per `add_bos`/`add_eos`; parse_special also turns the
        texts of control tokens (e.g. "<|eot_id|>") into their ids.
        """
        return self.encode_parts([(text, parse_special)], add_special)

    def encode_parts(self, parts: list[tuple[str, bool]], add_special: bool = False) -> list[int]:
        """Token ids of the concatenated texts, where each part says whether special-token
        texts inside it become their ids (template text) or stay plain text (message content).
        Only the special-token split is per part: the text between special tokens is
        tokenized as one piece across part boundaries, exactly as `encode` of the whole."""
        frags: list[str | int] = []
        for text, parse_special in parts:
            for fr in self._partition(text, parse_special) if text else []:
                if isinstance(fr, str) and frags and isinstance(frags[-1], str):
                    frags[-1] += fr
                else:
                    frags.append(fr)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # SPM: a fragment at the start or after a special token gets " "
        for fr in frags:
            if isinstance(fr, int):
                out.append(fr)
                prev_special = True
            elif self._spm:
                fr = (" " if self._add_space_prefix and prev_special else "") + fr
                out += self._encode_spm(fr)
                prev_special = False
            else:
                out += self._encode_bpe(fr)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _encode_bpe(self, text: str) -> list[int]:
        if not self._spm_style:
            return self._hf.encode(text, add_special_tokens=False).ids
        text = text.replace(" ", "\u2581")
        if not self._newline_runs:
            return self._hf.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for run in re.findall(r"\n+|[^\n]+", text):
            whole = self._ids.get(run) if run[0] == "\n" else None
            out += [whole] if whole is not None else self._hf.encode(run, add_special_tokens=False).ids
        return out

    def has_special_text(self, text: str) -> bool:
        """Whether `text` holds the text of a control token (it would change under parse_special)."""
        return any(isinstance(fr, int) for fr in self._partition(text, True)) and \
            self._partition(text, True) != self._partition(text, False)

    def token_text(self, id: int) -> str:
        """The vocabulary entry's text as stored (e.g. '<|im_end|>', '▁Hello', 'Ġworld')."""
        return self._texts[id]

    def is_control(self, id: int) -> bool:
        """Control/unknown tokens: split out of text only with parse_special, skipped when decoding."""
        return id in self._control or self._types[id] == _UNKNOWN

    def token_offsets(self, ids: list[int], text: str) -> list[int]:
        """Byte offset in `text` (UTF-8) where each token of `encode_parts`/`encode(text,
        add_special=False)` starts. Tokens give back their exact bytes except for the SPM
        dummy-prefix space (absent from the text) and whitespace eaten by rstrip/lstrip tokens;
        a dummy-prefix token starts where the text it prefixes starts."""
        raw, at, starts, prev = text.encode("utf-8"), 0, [], None
        for i in ids:
            piece = self.token_to_bytes(i, special=True)
            if prev in self._rstrip or i in self._lstrip:      # whitespace the token ate
                while at < len(raw) and raw[at:at + 1] in b" \t\n\v\f\r":
                    at += 1
            if raw.startswith(piece, at):
                starts.append(at)
                at += len(piece)
            elif piece.startswith(b" ") and raw.startswith(piece[1:], at):   # SPM dummy prefix
                starts.append(at)
                at += len(piece) - 1
            else:
                raise LlamatuneError(f"{self._path}: token {i} ({self._texts[i]!r}) does not match the text "
                                     f"at byte {at}")
            prev = i
        return starts

    def _encode_spm(self, text: str) -> list[int]:
        """Token ids of one fragment: sentencepiece's pieces, each a token's text, except
        the unknown ones (runs of characters that are no token), which become one byte
        token per UTF-8 byte, as llama.cpp's resegment() does. One encode to pieces and a
        lookup: an unknown run is never a token's text (the merges would have made it),
        and encoding to ids as well took twice as long (5.4 s against 2.6 s for
        shakespeare.txt's 1.65 M tokens with a llama vocabulary: each newline is unknown)."""
        out, ids = [], self._ids
        for piece in self._sp.encode(text, out_type=str):
            i = ids.get(piece)
            if i is not None:
                out.append(i)
                continue
            for at, ch in enumerate(piece):
                for b in ch.encode("utf-8"):
                    if self._byte_ids[b] is None:
                        self._fail(f"cannot encode {ch!r} (U+{ord(ch):04X}) in {_excerpt(piece, at)}: "
                                   f"the vocabulary has no byte token <0x{b:02X}>")
                    out.append(self._byte_ids[b])
        return out

    # ---- decoding ----
    def token_to_bytes(self, id: int, special: bool = False) -> bytes:
        """llama.cpp's token_to_piece as raw bytes (byte tokens may be partial UTF-8);
        with `special`, control tokens render as their text (e.g. '<s>'), as llama-tokenize shows them."""
        if not 0 <= id < self.n_vocab:
            raise LlamatuneError(f"{self._path}: token id {id} is out of range (vocabulary has {self.n_vocab})")
        text, ttype = self._texts[id], self._types[id]
        if id in self._control or ttype == _UNKNOWN:
            return text.encode("utf-8") if special else b""
        if ttype == _USER_DEFINED:
            return text.encode("utf-8")
        if ttype == _NORMAL and (self._spm or self._spm_style):   # SentencePiece-style pieces
            return text.replace("\u2581", " ").encode("utf-8")
        if ttype == _NORMAL:
            dec = _BYTE_DECODER
            if all(c in dec for c in text):
                return bytes(dec[c] for c in text)
            return b"".join(bytes([dec[c]]) if c in dec else
                            f"[UNK_BYTE_0x{c.encode('utf-8').hex()}{text}]".encode("utf-8") for c in text)
        if ttype == _BYTE and _BYTE_PIECE.match(text):
            return bytes([int(text[3:5], 16)])
        return b""   # unused / undefined tokens render as nothing

    def token_to_piece(self, id: int, special: bool = False) -> str:
        """One token's text for streaming output.  A byte-fallback token holding part of a
        multi-byte character gives U+FFFD here; stream `token_to_bytes` through an
        incremental UTF-8 decoder to avoid that."""
        return self.token_to_bytes(id, special).decode("utf-8", errors="replace")

    def decode(self, ids: list[int]) -> str:
        """llama_detokenize(ids, remove_special=false, unparse_special=false): control tokens
        (BOS/EOS/...) are skipped; the SPM dummy-prefix space is removed from the first
        token's piece only (so after a BOS, llama.cpp keeps it)."""
        pieces = [self.token_to_bytes(i) for i in ids]
        if pieces and self._add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces).decode("utf-8", errors="replace")
        if self._clean_spaces:   # detokenize()'s three clean-up passes
            text = re.sub(r" (?=[?!.,])", "", text)
            text = text.replace(" ' ", "'")
            text = re.sub(r" (?='[sm]|'re|'ve)", "", text)
        return text
