"""Correctness tools that verify rather than measure (bench/ holds the measurements):
the reader fuzzer (`fuzz`, `fuzz_mutate`), the cross-checks against a local llama.cpp
build (`llamacpp_crosscheck`, `arch_crosscheck`), llama.cpp's vocabulary suites
(`vocab_suites`), the memory estimate against measured peaks (`memory_check`), the
gated delta-net kernels against HF transformers' own code (`deltanet_hf`), HF's side
of the olmo2 / smollm3 / granite checks (`families_hf`: tiny models made by HF and
converted by llama.cpp's converter, HF's logits and LoRA gradients), GRPO's
arithmetic task scored on llama.cpp's own greedy completions (`grpo_arith`), and
the float64 numpy reference forward the tests and `arch_crosscheck` share
(`arch_reference`).

A package: run a tool from the repository root as `python -m checks.<tool>`; the
tests import them as `checks.<tool>` (pytest puts the repository root on the path,
pyproject.toml's `pythonpath`).
"""
