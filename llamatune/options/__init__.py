"""Options: the one source of defaults, for every command.

Each option is a dataclass field whose metadata carries its help text, help group and
command-line spellings (`fields.opt`); the CLI (cli/options_cli.py), the TOML presets
(`--config FILE`) and the checkpoints are all built from these fields. Precedence:
command line > preset file > default here.
  fields.py    opt, presets, build_options (the precedence), check_number
  training.py  TrainOptions, FinetuneOptions, ScratchOptions and their validation
  commands.py  the other commands' options
"""
from .commands import (LORA_HELP, LORA_SCALED_HELP, PREVIEW_FINETUNE_OPTIONS, ChatOptions, ChatSampling,
                       ConvertOptions, ExportOptions, MergeOptions, GenerateOptions, PerplexityOptions, PlotOptions, PreviewOptions,
                       QuickstartOptions, RunOptions, SamplingOptions, TokenizeOptions, scaled_adapters)
from .fields import build_options, check_needed, check_number, cli_flag, load_preset, opt, option_fields
from .training import (CHECKPOINTING, COS_DECAY_STEPS, G_CKPT, G_DATA, G_IO, G_LORA, G_MEM, G_MODEL, G_OPT, G_SCHED,
                       G_VAL, SEED, WARMUP, FinetuneOptions, ScratchOptions, TrainOptions, schedule_steps,
                       special_tokens, validate)

__all__ = ["LORA_HELP", "LORA_SCALED_HELP", "PREVIEW_FINETUNE_OPTIONS", "ChatOptions", "ChatSampling",
           "ConvertOptions", "ExportOptions", "MergeOptions", "GenerateOptions", "PerplexityOptions", "PlotOptions", "PreviewOptions",
           "QuickstartOptions", "RunOptions", "SamplingOptions", "TokenizeOptions", "scaled_adapters",
           "build_options", "check_needed", "check_number", "cli_flag", "load_preset", "opt", "option_fields",
           "CHECKPOINTING", "COS_DECAY_STEPS", "WARMUP", "schedule_steps",
           "G_CKPT", "G_DATA", "G_IO", "G_LORA", "G_MEM", "G_MODEL", "G_OPT", "G_SCHED", "G_VAL",
           "SEED", "FinetuneOptions", "ScratchOptions", "TrainOptions", "special_tokens", "validate"]
