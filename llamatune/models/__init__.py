"""Models: hyperparameters from GGUF metadata, one declaration per architecture, frozen
(quantized) weights, tokenizer and chat templates, the inference forward pass, and
writing whole model files. Imports formats/ and the core modules, never train/."""
