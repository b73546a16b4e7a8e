"""An Ollama Modelfile for a merged GGUF (`ollama create NAME -f DIR/Modelfile`).

Ollama imports a GGUF named by `FROM` (a path relative to the Modelfile's directory,
or absolute). Its prompt format is a Go template: when the Modelfile has no
TEMPLATE, `ollama create` picks one by matching the GGUF's tokenizer.chat_template
against the templates it ships, and otherwise falls back to the bare prompt. So for
the families llamatune knows (ChatML, Llama 3, Gemma, Phi-3) the Modelfile states the
template -- Ollama's own Go templates for those formats -- and the end-of-turn stop
strings; for any other template it leaves both to Ollama's detection and says so.
"""
from __future__ import annotations

import os
from pathlib import Path

from .gguf_io import atomic_path, write_error

# family -> (text that identifies the Jinja template, Go template, stop strings)
FAMILIES = {
    "chatml": ("<|im_start|>",
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
               "{{ end }}<|im_start|>assistant\n",
               ["<|im_end|>", "<|im_start|>"]),
    "llama3": ("<|start_header_id|>",
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
               "{{ .Content }}<|eot_id|>\n{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
               ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]),
    "gemma": ("<start_of_turn>",
              "{{- range $i, $_ := .Messages }}\n{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
              "{{- if or (eq .Role \"user\") (eq .Role \"system\") }}<start_of_turn>user\n{{ .Content }}<end_of_turn>\n"
              "{{ if $last }}<start_of_turn>model\n{{ end }}\n"
              "{{- else if eq .Role \"assistant\" }}<start_of_turn>model\n{{ .Content }}"
              "{{ if not $last }}<end_of_turn>\n{{ end }}\n{{- end }}\n{{- end }}",
              ["<end_of_turn>", "<start_of_turn>"]),
    "phi3": ("<|assistant|>",
             "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
             ["<|end|>", "<|user|>", "<|assistant|>"]),
}


def template_family(chat_template: str | None) -> str | None:
    """The known family of a Jinja chat template, or None."""
    if not chat_template:
        return None
    for family, (marker, _, _) in FAMILIES.items():
        if marker in chat_template:
            return family
    return None


def modelfile_text(model: Path, where: Path, chat_template: str | None) -> str:
    """The Modelfile for GGUF `model`, to be written in directory `where`."""
    try:
        rel = os.path.relpath(model.resolve(), where.resolve())
        src = rel if not rel.startswith("..") else str(model.resolve())
    except ValueError:                                   # another drive (Windows)
        src = str(model.resolve())
    src = src if os.path.isabs(src) else "./" + src
    lines = [f"# Made by llamatune export-lora. Create with: ollama create NAME -f {where / 'Modelfile'}",
             f"FROM {src}"]
    family = template_family(chat_template)
    if family is None:
        lines.append("# The model's chat template is not one llamatune knows: TEMPLATE and stop strings are left "
                     "to Ollama's detection from the GGUF's tokenizer.chat_template"
                     if chat_template else "# The model has no chat template: Ollama sends the bare prompt")
    else:
        _, go, stops = FAMILIES[family]
        lines.append(f'TEMPLATE """{go}"""')
        lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(directory: str | Path, model: str | Path, chat_template: str | None) -> Path:
    """Write DIR/Modelfile (atomically; DIR is created) for the GGUF `model`."""
    directory, model = Path(directory), Path(model)
    path = directory / "Modelfile"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(modelfile_text(model, directory, chat_template), encoding="utf-8")
    except OSError as e:
        raise write_error(path, e) from None
    return path
