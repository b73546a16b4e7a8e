"""Training data as files hold it: raw text cut into samples and batched (samples.py),
rows of SFT, preference and prompt datasets rendered and masked (datasets.py,
prompts.py), the rewards a prompt's completions are scored by (rewards.py), the record
of a run's data an adapter carries (recorded.py) and preview-data (preview.py). Imports models/ (tokenizer, chat templates), formats/ and
the core modules, never train/."""
