"""The jobs the command line runs (finetune, train-from-scratch, export-lora,
convert-checkpoint, perplexity, generate, chat), one module each, built on train/,
models/ and formats/. No command imports another; only the command line and the
quickstart tour (llamatune/quickstart.py) import them."""
