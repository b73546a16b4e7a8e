"""llama.cpp's BPE pre-tokenizers: for each `tokenizer.ggml.pre` name, the regexes that
split text before the merges and the flags llama.cpp sets with them.

Same data as `llm_tokenizer_bpe`'s constructor (regex_exprs, byte_encode) and the
`tokenizer_pre` branch of `llama_vocab::impl::load` (clean_spaces, ignore_merges, add_bos,
escape_whitespaces) in llama.cpp's src/llama-vocab.cpp. The regexes are llama.cpp's
adapted ones (case-insensitive groups spelled out), run by the `tokenizers` library's
Split pre-tokenizer, one after the other, each piece kept ("isolated").
"""
from __future__ import annotations

from typing import NamedTuple

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_CASE = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"   # tekken / gpt-4o: upper* lower+
_CASE2 = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"  # upper+ lower*
_PUNCT_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"   # tail of the cased-word regexes


def _cased(upper_lower: str, lower_upper: str, suffix: str, digits: str) -> str:
    """Words as "upper* lower+" or "upper+ lower*" (each with `suffix`), then digits, punctuation, spaces."""
    word = r"[^\r\n\p{L}\p{N}]?"
    return f"{word}{upper_lower}{suffix}|{word}{lower_upper}{suffix}|{digits}{_PUNCT_SPACES}"


_TEKKEN = _cased(_CASE, _CASE2, "", r"\p{N}")
_GPT4O = _cased(_CASE, _CASE2, _CONTRACTIONS + "?", r"\p{N}{1,3}")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# deepseek-llm's cased-letter class, as code points (the literal characters include
# singletons such as U+2126 OHM SIGN that Unicode normalization would silently change)
_DS_LETTERS = "".join(
    "-".join(chr(int(h, 16)) for h in r.split("-")) for r in """0041-005A 0061-007A 00B5 00C0-00D6
    00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF 0370-0373 0376 0377 037B-037D 037F 0386
    0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 048A-052F 0531-0556 10A0-10C5 13A0-13F5 13F8-13FD
    1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D
    1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3
    1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128
    212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2
    2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A
    FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF
    1E900-1E943""".split())
_DEEPSEEK_LLM = [r"[\r\n]", rf"\s?[{_DS_LETTERS}]+",
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK, r"\p{N}+"]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"]
_DEEPSEEK3 = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")]
_STARCODER = [r"\p{N}", _GPT2]
_SPARK = [*_DEEPSEEK3[:2], _DEEPSEEK3[2].replace(r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+", r"| ?[\p{P}\p{S}]+|[\r\n]"),
          r"\p{N}"]
# llama.cpp reads \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all as \p{L} (unicode.cpp's k_ucat_enum),
# so youtu's and tiny_aya's "upper* lower+" classes are letters-or-marks there: "XMLHttpRequest" is one piece
_UPPER = _LOWER = r"[\p{L}\p{M}]"
_YOUTU = [("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
           "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
          _cased(f"{_UPPER}*{_LOWER}+", f"{_UPPER}+{_LOWER}*", _CONTRACTIONS + "?", r"\p{N}")]
_CASE_M = r"((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"     # granite-embed-multi-97m
_CASE2_M = r"((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
_GRANITE_MULTI = _cased(_CASE_M, _CASE2_M, _CONTRACTIONS + "?", r"\p{N}{1,3}")
# "\d{1,3}(?=(?:\d{3})*\b)" runs in std::wregex there, where \d and \b are ASCII: digits in threes from the right
_TINY_AYA = [r"[0-9]{1,3}(?=(?:[0-9]{3})*(?![0-9A-Za-z_]))",
             _cased(f"{_UPPER}*{_LOWER}+", f"{_UPPER}+{_LOWER}*", _CONTRACTIONS + "?", r"\p{N}{1,3}")]
_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_UFAKZEKA = _QWEN2[len(_CONTRACTIONS) + 1:]       # qwen2 without the English contractions
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}")
_MINICPM5 = [r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+"]
_CHAMELEON = ["<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2]
_LINES = r"[^\n]+|[\n]+"                           # SPM-style BPE (gemma4, sarvam-moe): lines only


class PreTokenizer(NamedTuple):
    """One `tokenizer.ggml.pre` setting of llama_vocab::impl::load and llm_tokenizer_bpe."""
    regexes: list[str]
    clean_spaces: bool = True       # detokenize's clean-up passes
    ignore_merges: bool = False     # a pre-token that is a whole token is taken as it is
    add_bos: bool = False           # default of tokenizer.ggml.add_bos_token
    spm_style: bool = False         # spaces -> U+2581, raw UTF-8 pieces, <0xXX> byte fallback
    gemma4: bool = False            # BOS added whatever the GGUF says; a newline run that is a token stays whole


PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _pre(names: str, regexes: list[str], **flags) -> None:
    for name in names.split():
        PRE_TOKENIZERS[name] = PreTokenizer(regexes, **flags)


_pre("default", [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"])
_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", [_LLAMA3],
     ignore_merges=True, add_bos=True)
_pre("dbrx smaug-bpe chatglm-bpe", [_LLAMA3])
_pre("glm4 glm5", [_LLAMA3], ignore_merges=True)
_pre("minicpm5", _MINICPM5, ignore_merges=True)
_pre("deepseek-llm", _DEEPSEEK_LLM, clean_spaces=False)
_pre("deepseek-coder", _DEEPSEEK_CODER, clean_spaces=False)
_pre("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", _DEEPSEEK3, clean_spaces=False)
_pre("spark2_5", _SPARK, clean_spaces=False)
_pre("youtu", _YOUTU, clean_spaces=False, ignore_merges=True)
_pre("falcon", [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"])
_pre("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 mpt olmo jais "
     "jina-v1-en jina-v2-code roberta-bpe", [_GPT2])
_pre("jais-2", [_JAIS2])
_pre("trillion granite-docling", [_GPT2], clean_spaces=False)
_pre("starcoder refact codeshell exaone minerva-7b mellum2", _STARCODER)
_pre("command-r smollm", _STARCODER, clean_spaces=False)
_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2", [_QWEN2], clean_spaces=False)
_pre("qwen35", [_QWEN35], clean_spaces=False)
_pre("stablelm2 megrez", [_QWEN2])
_pre("ufakzeka", [_UFAKZEKA], clean_spaces=False)
_pre("laguna", [r"[^\n]+|[\n]+", _QWEN2], clean_spaces=False)
_pre("exaone-moe", [_EXAONE_MOE])
_pre("bloom gpt3-finnish", [_PORO])
_pre("poro-chat", [_PORO], clean_spaces=False)
_pre("viking", [_PORO, r"\p{N}"], clean_spaces=False)
_pre("tekken", [_TEKKEN], clean_spaces=False, ignore_merges=True, add_bos=True)
_pre("chameleon", _CHAMELEON, clean_spaces=False, add_bos=True)
_pre("gpt-4o llama4 kanana2 talkie minimax-m2", [_GPT4O], clean_spaces=False)
_pre("granite-embed-multi-97m", [_GRANITE_MULTI], clean_spaces=False, ignore_merges=True)
_pre("tiny_aya cohere2moe", _TINY_AYA, clean_spaces=False)
_pre("bailingmoe bailingmoe2 llada-moe", [_BAILING], clean_spaces=False)
_pre("seed-coder", [_SEED_CODER], clean_spaces=False)
_pre("gemma4 granite-embed-multi-311m", [_LINES], spm_style=True, gemma4=True)
_pre("sarvam-moe", [_LINES], spm_style=True, clean_spaces=False)
# Not here: kimi-k2 and afmoe (digit and Han splitting hand-coded in llama.cpp's unicode.cpp),
# superbpe (a zero-width split), whitespace/hybriddna (tokenizer models of their own).
