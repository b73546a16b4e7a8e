"""llamatune: LoRA finetuning of GGUF llama-family models."""
__version__ = "0.1.0"
