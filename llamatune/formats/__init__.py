"""File formats: GGUF bytes (the one layer that reads and writes them), tensor checks,
LoRA adapters (llama.cpp's GGUF adapter layout) and PEFT safetensors adapters.
Imports only llamatune's core modules and kernels."""
