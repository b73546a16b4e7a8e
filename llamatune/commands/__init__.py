"""The jobs the command line runs (finetune, train-from-scratch, export-lora,
convert-checkpoint, perplexity, generate, chat, quickstart), one module each, built on
train/, models/ and formats/. Nothing below imports from here."""
