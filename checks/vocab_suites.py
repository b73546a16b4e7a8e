"""Every llama.cpp vocab suite against llamatune's tokenizer (a script, not a test: it needs
llama.cpp's source tree, and its build for the checks that call llama.cpp).

llama.cpp ships `src/models/ggml-vocab-NAME.gguf` vocabularies with `.inp` (texts, each
followed by "\\n__ggml_vocab_test__\\n") and `.out` (the ids test-tokenizer-0 got, one line
per text, no special tokens added or parsed). For each vocabulary this prints:

  encode  texts whose ids equal the .out line; a vocabulary without .inp/.out (aquila,
          baichuan, gpt-neox) takes llama-spm's texts and llama.cpp's ids computed now;
  decode  texts where `decode(ids)` equals llama.cpp's `llama_detokenize(ids,
          remove_special=false, unparse_special=false)` of the same ids;
  special texts whose `encode(text, add_special=True, parse_special=True)` equals
          llama.cpp's `llama_tokenize(..., add_special=true, parse_special=true)`.

The last two need llama.cpp's library: a small C program (`REFERENCE_C`, below) is
compiled against LLAMA_CPP/build/bin/libllama.so. Tokenizer models llamatune does not
implement (WordPiece "bert", Unigram "t5") are listed as out of scope.

--pre-tokenizers checks every `tokenizer.ggml.pre` name of llamatune's table, most of which
no suite uses: qwen35's vocabulary (gemma-4's for the SentencePiece-style ones) is
written again with that name, and llama.cpp and llamatune tokenize the suite texts plus
some digit, CJK and Hangul texts with it; the ids must agree.

    python -m checks.vocab_suites [--llama-cpp llama.cpp] [--pre-tokenizers] [NAME ...]

Exit status: 0 when every in-scope suite passes everything it could check, 1 otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

SEP = "\n__ggml_vocab_test__\n"
OUT_OF_SCOPE = {"bert": "WordPiece (BERT embedding models; llamatune finetunes decoders)",
                "t5": "Unigram (T5 / nomic-bert-moe encoders; llamatune finetunes decoders)"}

# tokenize every text of stdin with llama.cpp, and detokenize the ids it got (twice:
# unparse_special false and true); one line per text: ids, TAB, hex bytes, TAB, hex bytes
REFERENCE_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"
static void quiet(enum ggml_log_level l, const char *t, void *u) { (void)l; (void)t; (void)u; }
static void hex(const char *s, int n) { for (int i = 0; i < n; i++) printf("%02x", (unsigned char)s[i]); }
int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s MODEL ADD_SPECIAL PARSE_SPECIAL < texts\n", argv[0]); return 2; }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = 1;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int add_special = atoi(argv[2]), parse_special = atoi(argv[3]);
    size_t cap = 1 << 20, len = 0, r;
    char *buf = malloc(cap);
    while ((r = fread(buf + len, 1, cap - len, stdin)) > 0) { len += r; if (len == cap) buf = realloc(buf, cap *= 2); }
    const char *sep = "\n__ggml_vocab_test__\n";
    size_t ns = strlen(sep), at = 0;
    llama_token *toks = malloc(sizeof(llama_token) * (len + 16));
    char *out = malloc(4 * len + 4096);
    while (at < len) {
        char *end = memmem(buf + at, len - at, sep, ns);
        if (!end) break;
        int n = llama_tokenize(vocab, buf + at, (int)(end - buf - at), toks, (int)(len + 16), add_special, parse_special);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", toks[i]);
        for (int unparse = 0; unparse < 2; unparse++) {
            int m = llama_detokenize(vocab, toks, n, out, (int)(4 * len + 4096), 0, unparse);
            printf("\t");
            hex(out, m);
        }
        printf("\n");
        at = end - buf + ns;
    }
    llama_model_free(model);
    return 0;
}
"""


class Reference(NamedTuple):
    ids: list[int]
    text: bytes            # llama_detokenize(ids, remove_special=false, unparse_special=false)
    text_special: bytes    # the same with unparse_special=true


class LlamaCpp:
    """llama.cpp's own tokenize/detokenize through its shared library."""

    def __init__(self, root: Path):
        self.root = root
        self.lib = root / "build" / "bin"
        self.exe: Path | None = None
        self.problem = None
        if not (self.lib / "libllama.so").exists():
            self.problem = f"no {self.lib / 'libllama.so'}"
            return
        work = Path(tempfile.mkdtemp(prefix="llamatune-vocab-"))
        (work / "reference.c").write_text(REFERENCE_C)
        cmd = ["gcc", "-O1", "-D_GNU_SOURCE", "-o", str(work / "reference"), str(work / "reference.c"),
               f"-I{root / 'src' / 'include'}", f"-I{root / 'src' / 'ggml' / 'include'}",
               f"-L{self.lib}", "-lllama", f"-Wl,-rpath,{self.lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            self.problem = f"cannot compile the reference program: {done.stderr.strip()[:300]}"
        else:
            self.exe = work / "reference"

    def run(self, model: Path, texts: list[str], add_special: bool, parse_special: bool) -> list[Reference]:
        if self.exe is None:
            raise RuntimeError(self.problem)
        data = "".join(t + SEP for t in texts).encode("utf-8")
        done = subprocess.run([str(self.exe), str(model), str(int(add_special)), str(int(parse_special))],
                              input=data, capture_output=True, check=True)
        rows = []
        for line in done.stdout.decode("ascii").split("\n")[:-1]:
            ids, text, special = line.split("\t")
            rows.append(Reference([int(x) for x in ids.split()], bytes.fromhex(text), bytes.fromhex(special)))
        assert len(rows) == len(texts), f"{model}: {len(rows)} results for {len(texts)} texts"
        return rows


def read_suite(gguf: Path) -> list[tuple[str, list[int]]] | None:
    """(text, ids) of a suite's .inp/.out; the last text may lack its separator."""
    inp, out = gguf.with_suffix(".gguf.inp"), gguf.with_suffix(".gguf.out")
    if not (inp.exists() and out.exists()):
        return None
    raw = inp.read_bytes().decode("utf-8")
    texts = raw.split(SEP)
    if raw.endswith(SEP):
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in out.read_text(encoding="utf-8").split("\n")[:-1]]
    assert len(texts) == len(ids), f"{inp}: {len(texts)} texts but {len(ids)} id lines"
    return list(zip(texts, ids))


def check(path: Path, llama: LlamaCpp, spm_texts: list[str]) -> tuple[str, bool]:
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer

    f = GGUFFile(path)
    model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre")
    head = f"{path.name[len('ggml-vocab-'):-len('.gguf')]:16s} {model:7s} {pre!s:15s}"
    if model in OUT_OF_SCOPE:
        return f"{head} out of scope: {OUT_OF_SCOPE[model]}", True
    cases = read_suite(path)
    source = ".out"
    if cases is None:
        if llama.exe is None:
            return f"{head} no .inp/.out and no llama.cpp library to compute ids ({llama.problem})", False
        cases = [(t, r.ids) for t, r in zip(spm_texts, llama.run(path, spm_texts, False, False))]
        source = "llama.cpp now"
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = Tokenizer.from_gguf(f)
    load_s = time.perf_counter() - t0
    texts = [t for t, _ in cases]
    enc = sum(tok.encode(t, add_special=False) == ids for t, ids in cases)
    line = f"{head} encode {enc}/{len(cases)} ({source})"
    ok = enc == len(cases)
    if llama.exe is not None:
        ref = llama.run(path, texts, False, False)
        dec = sum(tok.decode(ids) == r.text.decode("utf-8", errors="replace") for (_, ids), r in zip(cases, ref))
        special = llama.run(path, texts, True, True)
        spc = sum(tok.encode(t, add_special=True, parse_special=True) == r.ids for t, r in zip(texts, special))
        line += f"  decode {dec}/{len(cases)}  special {spc}/{len(cases)}"
        ok = ok and dec == spc == len(cases)
    return f"{line}  load {load_s:.1f}s  {'OK' if ok else 'FAIL'}", ok


EXTRA_TEXTS = ["1234567 12,345,678 3.14159 0x1F 2024-06-01", "한국어 텍스트 ㄱㄴㄷ ㄅㄆ", "日本語のテキスト、カタカナ！",
               "Ünïcödé ÀÉÎ ǅungla e\u0301 HTTPServer's XMLHttpRequest I'M SHOUTING", "<sentinel:12> IMGIMGABZ",
               "tabs\t\tand\r\nnewlines\n\n\n  spaces   end  ", "中文，标点。English—mix…‘quoted’",
               "हिन्दी भाषा नमस्ते", "ภาษาไทย สวัสดี", "العربية مَرْحَبًا", "cafe\u0301 re\u0301sume\u0301 n\u0303o"]


def check_pre_tokenizers(llama: LlamaCpp, models: Path, texts: list[str]) -> bool:
    """Every pre-tokenizer name of the table on a real vocabulary, llamatune vs llama.cpp."""
    from llamatune.formats.gguf_io import GGUFFile, write_gguf
    from llamatune.models.pretokenizers import PRE_TOKENIZERS
    from llamatune.models.tokenizer import Tokenizer

    if llama.exe is None:
        print(f"--pre-tokenizers needs llama.cpp's library: {llama.problem}")
        return False
    # qwen35's multilingual merges tell marks from letters (Thai, Arabic vowel signs)
    sources = {False: GGUFFile(models / "ggml-vocab-qwen35.gguf"), True: GGUFFile(models / "ggml-vocab-gemma-4.gguf")}
    work = Path(tempfile.mkdtemp(prefix="llamatune-pre-"))
    all_ok = True
    for name, setting in sorted(PRE_TOKENIZERS.items()):
        src = sources[setting.spm_style]
        kvs = [item for key, item in src.kvs.items()
               if key not in ("tokenizer.ggml.pre", "tokenizer.ggml.model") and not key.startswith("tokenizer.chat")]
        kvs += [src.kvs["general.name"]._replace(key="tokenizer.ggml.model", value="gpt2"),
                src.kvs["general.name"]._replace(key="tokenizer.ggml.pre", value=name)]
        path = work / "vocab.gguf"
        write_gguf(path, src.get("general.architecture"), kvs, [])
        tok = Tokenizer.from_gguf(GGUFFile(path))
        ref = llama.run(path, texts, False, False)
        wrong = [t for t, r in zip(texts, ref) if tok.encode(t, add_special=False) != r.ids]
        print(f"pre {name:26s} {len(texts) - len(wrong)}/{len(texts)}"
              + (f"  first difference: {wrong[0][:40]!r}" if wrong else ""), flush=True)
        all_ok &= not wrong
    return all_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("llama.cpp"),
                    help="llama.cpp checkout with src/ (source tree) and build/bin (its build)")
    ap.add_argument("--pre-tokenizers", action="store_true",
                    help="check every pre-tokenizer name on a real vocabulary instead of the suites")
    ap.add_argument("names", nargs="*", help="only these suites (e.g. qwen35 gemma-4)")
    args = ap.parse_args()
    models = args.llama_cpp / "src" / "models"
    paths = sorted(models.glob("ggml-vocab-*.gguf"))
    if not paths:
        print(f"no ggml-vocab-*.gguf under {models}", file=sys.stderr)
        return 1
    llama = LlamaCpp(args.llama_cpp)
    if llama.exe is None:
        print(f"decode/special columns skipped: {llama.problem}")
    spm = read_suite(models / "ggml-vocab-llama-spm.gguf") or []
    if args.pre_tokenizers:
        qwen35 = read_suite(models / "ggml-vocab-qwen35.gguf") or []
        texts = list(dict.fromkeys([t for t, _ in spm + qwen35] + EXTRA_TEXTS))
        return 0 if check_pre_tokenizers(llama, models, texts) else 1
    all_ok = True
    for path in paths:
        if args.names and path.name[len("ggml-vocab-"):-len(".gguf")] not in args.names:
            continue
        line, ok = check(path, llama, [t for t, _ in spm])
        print(line, flush=True)
        all_ok &= ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
