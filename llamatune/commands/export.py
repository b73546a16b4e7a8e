"""Merge LoRA adapters into a GGUF model (`llamatune export-lora`).

Mirrors llama.cpp's tools/export-lora (export-lora.cpp): every base weight W that
an adapter touches becomes, in f32 and one tensor at a time,

    W' = deq(W) + sum_i s_i · B_i A_i,    s_i = user_scale_i · alpha_i / r_i   (user_scale_i if alpha_i = 0)

with A_i (r, n_in), B_i (n_out, r) in numpy order; tensors without adapters are
copied byte for byte and every metadata key is kept with its type.

Deliberate differences from llama.cpp:
  - a merged tensor keeps its base type (a Q4_K weight is re-quantized to Q4_K);
    llama.cpp writes merged quantized tensors as F16 and sets file_type F16.
    `outtype` may instead name one type for every matrix (llama-quantize style);
  - norm adapters (w (C,), A (r, C), B (1, r)) are merged: w' = w + s · (B A)[0]
    (llama.cpp ignores them at run time and has no case for them here);
  - token_embd uses llama.cpp's flipped run-time layout, A (V, r), B (C, r),
    delta = s · A B^T (V, C); export-lora applies the plain formula to it;
  - adapters may adapt different tensor sets (reported, not an error), and
    quantized adapter tensors are dequantized rather than rejected;
  - all problems of all adapters are collected into one error before anything is
    written, and the output appears atomically (never half-written).

Re-quantization (`merge.merge_method`): "plain" is round to nearest (the type's
quantizer, as llama-quantize without an imatrix). "compensated" (the default)
quantizes each merged matrix with kernels/compensate.py: llama.cpp's importance-
weighted quantizer on the input columns' mean x^2 (from --imatrix or
--calibration-data), GPTQ-style error compensation through each input's second
moment (from --calibration-data only; Calibration runs the base + adapters over the
text), and per block the base's own code wherever it is at least as close to the
merged weight. Given neither, the training data the first adapter records
(data/recorded.py) is the calibration text while its sha256 matches: a sample of
--calibration-chunks x --calibration-ctx tokens, rendered as training rendered it, in
windows of --calibration-ctx, as --calibration-data (rows of a shorter training --ctx
follow one another, as the text does; windows of a training --ctx of 128 kept 85 % of
the KL shift on Qwen2.5-Coder-0.5B Q4_K_M, docs/performance.md). Where the file is gone
or was edited, the imatrix
`finetune` wrote beside the adapter (adapter-N.imatrix.gguf for adapter-N.gguf) is
used when it exists, and the output ends with a warning. Without statistics that
is round to nearest keeping the base's blocks that are as close (a zero adapter gives
back the base's bytes). After the merge, models/survival.py says what of the adapters
the merged tensors kept, with a warning when that is nothing or too little.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..console import notice
from ..data.recorded import calibration_windows as recorded_windows
from ..data.recorded import check as check_recorded
from ..data.recorded import recorded_data
from ..errors import LlamatuneError, listed
from ..formats.adapter import LoraAdapter, RuntimeAdapters, is_norm, read_adapter
from ..formats.gguf_io import KV, GGUFFile, Tensor, TensorOut, kv, write_gguf
from ..formats.imatrix import IMatrix, beside, check_against, read_imatrix, write_imatrix
from ..formats.ollama import write_modelfile
from ..kernels import dequant
from ..kernels.cpuinfo import blas_one_thread
from ..kernels.compensate import DAMP, inverse_cholesky, quantize_compensated
from ..kernels.quantize import QUANTIZABLE, quantize
from ..locks import hold
from ..models.survival import Survival
from ..models.writer import FILE_TYPE, out_type, parse_outtype
from ..options import MergeOptions
from ..outputs import Out, check_paths

TOKEN_EMBD = "token_embd.weight"
# a merge estimated to keep less of the adapter's KL shift than this ends with a warning (models/survival.py's
# "kept"): on Qwen2.5-Coder-0.5B the plain Q4_K_M merge of 40 steps read 18 % and kept 21 % measured, the
# calibrated Q4_0 one 80 % (77 % measured)
KEPT_LOW = 0.5
# what the merge with finetune's imatrix alone loses: on Qwen2.5-Coder-0.5B at Q4_0 (40 steps of Shakespeare,
# llama-perplexity --kl-divergence) it kept 48 % of the KL shift, calibrated on the training text 93.5 %
FALLBACK_LOSS = "much less of the adapter in 4-bit types (at Q4_0 about half of it: 48 % of the KL shift, not 93 %)"

# One adapter term for one weight: (A, B, s) as in the module docstring.
Delta = tuple[np.ndarray, np.ndarray, float]


@dataclass
class ExportReport:
    """What export_lora wrote."""
    path: Path
    merged: dict[str, str] = field(default_factory=dict)   # merged tensor name -> output type name
    n_copied: int = 0        # tensors copied byte for byte
    n_converted: int = 0     # tensors without adapters converted to an explicit outtype
    notes: list[str] = field(default_factory=list)          # also printed as notices
    statistics: str = "none"  # what the compensated merge used: none, imatrix, calibration
    n_calibration_passes: int = 0
    modelfile: Path | None = None
    imatrix: Path | None = None   # the training imatrix found beside an adapter (without --imatrix)
    calibration: str = ""         # which statistics the merge used, from which file (the start line)
    survival: str = ""            # models/survival.py's summary line
    warnings: list[str] = field(default_factory=list)   # each ends the output as one line

    @property
    def n_merged(self) -> int:
        return len(self.merged)


def export_lora(model_base: str | Path, adapters: list[tuple[str | Path, float]], out: str | Path,
                outtype: str = "same", merge: MergeOptions | None = None,
                progress=None) -> ExportReport:
    """Merge `adapters` [(path, user_scale)] into `model_base` and write `out`.
    outtype "same" keeps each tensor's type; f32/f16/bf16/q8_0/.../q6_k converts
    every matrix (1-D tensors stay F32). `merge` says how merged weights are
    re-quantized (default: compensated) and whether an Ollama Modelfile is written.
    Raises LlamatuneError before writing."""
    options = merge or MergeOptions()
    options.check()
    target = None if outtype.lower() == "same" else parse_outtype(outtype)
    output = Out("--output", Path(out))
    outputs = ([output] + ([Out("--imatrix-out", options.imatrix_out)] if options.imatrix_out else [])
               + ([Out("--ollama", options.ollama / "Modelfile")] if options.ollama else []))
    check_paths([("--model-base", Path(model_base))] + [("--lora", Path(p)) for p, _ in adapters]
                + [("--imatrix", options.imatrix), ("--calibration-data", options.calibration_data)], outputs)
    for flag, p in (("--imatrix", options.imatrix), ("--calibration-data", options.calibration_data)):
        if p is not None and not Path(p).is_file():
            raise LlamatuneError(f"{flag} {p}: file not found")
    with hold(outputs, "export-lora"):           # before loading: another run may be writing `out`
        return _export(model_base, adapters, Path(out), target, options, progress)


def _export(model_base: str | Path, adapters: list[tuple[str | Path, float]], out: Path,
            target: QType | None, options: MergeOptions, progress) -> ExportReport:
    """export_lora once its paths are checked and its outputs are locked."""
    base = GGUFFile(model_base)
    if base.get("general.type") == "adapter":
        raise LlamatuneError(f"{base.path}: is a LoRA adapter, not a model (pass it with --lora)")
    loaded = _load_adapters(base, adapters, out)
    report = ExportReport(out, notes=_set_differences(loaded))
    imatrix = None
    source, recorded = _statistics(loaded, options, report)
    if source is not None:
        imatrix = read_imatrix(source)
        check_against(imatrix, Path(source), {n: t.n_cols for n, t in base.tensors.items()})

    # Every adapter term per base weight, in the order the adapters were given.
    deltas: dict[str, list[Delta]] = {}
    for adapter, user_scale in loaded:
        for name, (a, b) in adapter.pairs.items():
            deltas.setdefault(name, []).append((a, b, adapter.scale(name, user_scale)))
    if TOKEN_EMBD in deltas and "output.weight" not in base.tensors:
        report.notes.append("the model ties output to token_embd: the merged token_embd adapter also changes "
                            "the output projection (at run time llama.cpp applies it to the input only)")

    requant = _requant(base, loaded, deltas, target, options, recorded, imatrix, progress, report)
    survival = Survival(metric={"calibration": "the calibration's inputs", "imatrix": "the imatrix"}.get(
        report.statistics, "the weights alone"))
    tensors, problems = _planned(base, deltas, target, requant, survival, report)
    if problems:
        raise LlamatuneError("cannot export: " + listed(problems))
    for note in report.notes:
        notice(note)
    write_gguf(out, base.arch, _metadata(base, target), tensors)
    if requant.calibration is not None:
        report.n_calibration_passes = requant.calibration.n_passes
    _survived(report, survival)
    if options.ollama is not None:
        report.modelfile = write_modelfile(options.ollama, out, base.get("tokenizer.chat_template"))
    return report


def _requant(base: GGUFFile, loaded: list[tuple[LoraAdapter, float]], deltas: dict[str, list[Delta]],
             target: QType | None, options: MergeOptions, recorded: "_Sample | None", imatrix: IMatrix | None,
             progress, report: ExportReport) -> "_Requant":
    """The re-quantizer of merged matrices; for the compensated merge, calibrated on
    --calibration-data or the recorded training sample where either is given and a
    merged matrix has a block type (report.statistics says what it had)."""
    requant = _Requant(options.merge_method, imatrix)
    if options.merge_method != "compensated":
        return requant
    blocky = [t.name for t in base.tensors.values() if t.name in deltas and t.name != TOKEN_EMBD
              and len(t.shape) == 2 and _is_block_type(out_type(t, target, True, lambda _: None))]
    sample = recorded if options.calibration_data is None else _text_sample(options)
    if sample is not None and blocky:
        requant.calibration = _calibrate(base, loaded, options, blocky, progress, sample)
        requant.imatrix = requant.calibration.imatrix(sample.name)
        if options.imatrix_out is not None:
            write_imatrix(options.imatrix_out, requant.imatrix, base.arch)
    report.statistics = ("calibration" if requant.calibration else "imatrix" if imatrix else "none")
    if report.statistics == "none" and blocky:
        report.notes.append("no --calibration-data or --imatrix: merged blocks are rounded to nearest, keeping "
                            "each base block that is as close (give one for an output-aware merge)")
    return requant


def _planned(base: GGUFFile, deltas: dict[str, list[Delta]], target: QType | None, requant: "_Requant",
             survival: Survival, report: ExportReport) -> tuple[list[TensorOut], list[str]]:
    """Every output tensor in the base's order: copied byte for byte, or merged (converted)
    by the writer when it reaches it; and the tensors that cannot be merged."""
    tensors: list[TensorOut] = []
    problems: list[str] = []
    for t in base.tensors.values():
        merge = deltas.get(t.name)
        qtype = out_type(t, target, merge is not None, report.notes.append)
        if merge is None and (qtype == t.qtype or not _can_dequantize(t)):
            if qtype != t.qtype:
                report.notes.append(f"{t.name}: type {t.qtype.name} cannot be converted; copied unchanged")
            tensors.append(TensorOut(t.name, t.shape, t.qtype, t.raw_rows))     # byte-for-byte copy
            report.n_copied += 1
            continue
        if not _can_dequantize(t):
            problems.append(f"{base.path}: tensor '{t.name}' has type {t.qtype.name}, which cannot be "
                            "dequantized to merge an adapter into it")
            continue
        if merge is None:
            report.n_converted += 1
        else:
            report.merged[t.name] = qtype.name
        tensors.append(TensorOut(t.name, t.shape, qtype, partial(_merge, t, merge or [], qtype, requant,
                                                                  survival if merge else None)))
    return tensors, problems


def _load_adapters(base: GGUFFile, adapters: list[tuple[str | Path, float]],
                   out: Path) -> list[tuple[LoraAdapter, float]]:
    """Read and validate every adapter against the base; one error lists all problems."""
    if not adapters:
        raise LlamatuneError("export-lora: no adapters given (use --lora or --lora-scaled)")
    problems: list[str] = []
    loaded = []
    for path, user_scale in adapters:
        if not math.isfinite(user_scale):
            problems.append(f"{path}: scale {user_scale} is not a finite number")
        try:
            loaded.append((read_adapter(path, base), float(user_scale)))
        except LlamatuneError as e:       # missing file, not an adapter, arch, names, shapes, halves
            problems.append(str(e))
    if problems:
        numbered = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise LlamatuneError(f"export-lora: {len(problems)} problem(s), nothing written: {numbered}")
    return loaded


def _statistics(loaded: list[tuple[LoraAdapter, float]], options: MergeOptions,
                report: ExportReport) -> tuple[Path | None, "_Sample | None"]:
    """Which statistics the compensated merge uses, said in one line before the work:
    --imatrix; --calibration-data; else the training data the first adapter records
    (data/recorded.py) when it is there unchanged, sampled and rendered as training
    rendered it; else the imatrix finetune wrote beside the adapter, with a warning to
    end the output when recorded data is gone or was edited. Returns (the imatrix file
    to read, the recorded sample to calibrate on)."""
    if options.merge_method != "compensated":
        return None, None
    if options.imatrix is not None:
        report.calibration = f"the importance matrix --imatrix {options.imatrix}"
    elif options.calibration_data is not None:
        report.calibration = f"--calibration-data {options.calibration_data}"
    if report.calibration:
        notice(f"statistics: {report.calibration}")
        return options.imatrix, None
    record = recorded_data(GGUFFile(loaded[0][0].path))
    problem = None if record is None else check_recorded(record)
    if record is not None and problem is None:
        report.calibration = (f"the training data {record.path}, as finetune rendered it (its sha256 matches "
                              f"{loaded[0][0].path.name}'s record)")
        notice(f"calibration: {report.calibration}")
        return None, _Sample(str(record.path), lambda tok: recorded_windows(
            record, tok, options.calibration_chunks * options.calibration_ctx, options.calibration_ctx))
    source = _training_imatrix(loaded)
    if source is not None:
        report.calibration = f"the imatrix finetune wrote beside {loaded[0][0].path.name}: {source}"
        notice(f"statistics: {report.calibration} (per-column weights only)")
        report.imatrix = source
    if record is not None:
        used = "finetune's imatrix only" if source is not None else "no statistics (rounded to nearest)"
        report.warnings.append(f"{problem}: merged with {used}, which keeps {FALLBACK_LOSS}; for the full merge "
                               f"pass --calibration-data with the training data (it was {record.path})")
    return source, None


def _training_imatrix(loaded: list[tuple[LoraAdapter, float]]) -> Path | None:
    """The imatrix finetune writes beside the first adapter (adapter-N.imatrix.gguf),
    when it exists; None otherwise (then: the merge without statistics)."""
    path = beside(loaded[0][0].path)
    return path if path.is_file() else None


def _survived(report: ExportReport, survival: Survival) -> None:
    """The summary line of what the merge kept, and its warning (before the others)."""
    types = ", ".join(sorted({q for q in report.merged.values() if _is_block_type(QType[q])})) or "the output type"
    report.survival = survival.summary(types)
    warning = survival.warning(KEPT_LOW, types)
    if warning is not None:
        report.warnings.insert(0, warning)


def _set_differences(loaded: list[tuple[LoraAdapter, float]]) -> list[str]:
    """llama.cpp's export-lora requires one tensor set for all adapters; we merge each
    adapter where it applies and only report the differences."""
    sets = [set(adapter.pairs) for adapter, _ in loaded]
    union = set().union(*sets)
    notes = []
    for (adapter, _), names in zip(loaded, sets):
        missing = sorted(union - names)
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            notes.append(f"{adapter.path.name} does not adapt {len(missing)} tensor(s) that other adapters "
                         f"do ({shown}); merged where present (llama.cpp's export-lora would refuse)")
    return notes


def _can_dequantize(t: Tensor) -> bool:
    if t.qtype in dequant.NUMBA_TYPES:
        return True
    try:
        dequant.dequantize(t.raw_rows()[:1], t.qtype, t.n_cols)
        return True
    except ValueError:
        return False


def _merge(t: Tensor, deltas: list[Delta], qtype: QType, requant: "_Requant",
           survival: Survival | None = None) -> np.ndarray:
    """deq(W) + sum_i s_i · delta_i in f32 (rows, cols), encoded as `qtype`.
    Called by the writer when it reaches `t`: one tensor is in memory at a time.
    `survival` measures what of the deltas the codes kept. BLAS runs at one thread: the
    products are many and small (rank-r deltas, factors of at most --calibration-block
    columns, the sweep's column groups); on 2 shared cores the default export of
    Qwen2.5-Coder-0.5B Q4_K_M took 91 s CPU, 312 s wall with 2 BLAS threads and 43 s,
    164 s with one, the same bytes."""
    with blas_one_thread():
        return _merged(t, deltas, qtype, requant, survival)


def _merged(t: Tensor, deltas: list[Delta], qtype: QType, requant: "_Requant",
            survival: Survival | None) -> np.ndarray:
    """_merge's work."""
    w = dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols)       # fresh (rows, cols) f32; norms (1, C)
    for a, b, s in deltas:
        # token_embd: A (V, r), B (C, r) -> (V, C); others (incl. norms): B (n_out, r) @ A (r, n_in);
        # a 3-D expert tensor: B[e] @ A[e] per expert, its (E * n_out, n_in) rows as stored
        w += np.float32(s) * (a @ b.T if t.name == TOKEN_EMBD else (b @ a).reshape(w.shape))
    if qtype == QType.F32:
        out = w
    elif not deltas or not _is_block_type(qtype) or requant.method == "plain":
        out = quantize(w, qtype)
    else:
        out = requant(t, w, qtype)
    if survival is not None:
        h, qw = requant.metric(t.name)
        survival.add(t, deltas, out, qtype, _is_block_type(qtype), h, qw)
    return out


_FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})


def _is_block_type(qtype: QType) -> bool:
    return qtype in QUANTIZABLE and qtype not in _FLOAT_TYPES


class _Requant:
    """The compensated re-quantization of merged matrices, with whatever statistics exist."""

    def __init__(self, method: str, imatrix: IMatrix | None):
        self.method, self.imatrix = method, imatrix
        self.calibration = None
        self._factors: dict[str, np.ndarray] = {}      # input key -> U, this layer's (q/k/v share one)
        self._metric: tuple[str, object, object] = ("", None, None)   # the last weight's (name, H, qw)

    def metric(self, name: str) -> tuple[object, np.ndarray | None]:
        """(H or its diagonal blocks, mean x^2 per column) the last call used for weight
        `name`, each None when it had none."""
        return self._metric[1:] if self._metric[0] == name else (None, None)

    def __call__(self, t: Tensor, w: np.ndarray, qtype: QType) -> np.ndarray:
        base = t.raw_rows() if t.qtype == qtype else None          # the base's codes: kept where as close
        qw = None if self.imatrix is None or t.name == TOKEN_EMBD else self.imatrix.importance(t.name)
        found = self.calibration.hessian(t.name) if self.calibration is not None else None
        self._metric = (t.name, None if found is None else found[1], qw)
        if found is not None:
            key, h = found
            if key not in self._factors:
                if len(self._factors) >= 4:         # a llama layer has 4 distinct inputs, in file order
                    self._factors.pop(next(iter(self._factors)))     # mixed (k, o, q, v): keep a layer's
                self._factors[key] = inverse_cholesky(h, dtype=np.float32)     # as GPTQ; twice f64 rate
            u = self._factors[key]
        elif qw is not None:                                        # diagonal H: weighted, no compensation
            d = qw.astype(np.float64) + DAMP * max(float(qw.mean()), 1e-30)
            u = 1 / np.sqrt(d)
        else:
            u = np.ones(t.n_cols)
        return quantize_compensated(w, qtype, u, qw, base, overwrite=True)    # w: _merge's own


@dataclass
class _Sample:
    """Calibration text: its name (the imatrix's dataset) and its windows for a tokenizer."""
    name: str
    windows: object        # tokenizer -> (n, T) token ids


def _text_sample(merge: MergeOptions) -> _Sample:
    """--calibration-data: the text's first windows (models/calibration.py)."""
    from ..models.calibration import calibration_windows
    path = Path(merge.calibration_data)

    def windows(tokenizer):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise LlamatuneError(f"{path}: calibration text is not UTF-8") from None
        return calibration_windows(tokenizer, text, merge.calibration_ctx, merge.calibration_chunks, str(path))
    return _Sample(str(path), windows)


def _calibrate(base: GGUFFile, loaded: list[tuple[LoraAdapter, float]], merge: MergeOptions,
               ordered: list[str], progress, sample: _Sample | None = None):
    """Run the base + adapters (applied at run time, norms aside) over the sample's windows
    (by default those of --calibration-data)."""
    from ..models.calibration import Calibration
    from ..models.infer import Runner
    from ..models.model import Model
    from ..precision import policy
    model = Model(base)
    runtime = RuntimeAdapters()
    for adapter, user_scale in loaded:
        for name, (a, b) in adapter.pairs.items():
            if not is_norm(name):
                runtime.add(name, a, b, adapter.scale(name, user_scale))
    windows = (sample or _text_sample(merge)).windows(model.tokenizer)
    compute = policy("auto")       # statistics need no f32 products: bf16 where the CPU has it
    # forwards of 4 x --calibration-ctx tokens (4 windows of 512: the second moments' products get K = 2048)
    batch = max(1, 4 * merge.calibration_ctx // windows.shape[1])
    return Calibration(Runner(model, runtime, policy=compute), windows, ordered, merge.calibration_memory << 20,
                       batch=batch, progress=progress, bf16=compute.dtype == "bf16", block=merge.calibration_block)


def _metadata(base: GGUFFile, target: QType | None) -> list[KV]:
    """The base's KVs, exactly; general.file_type follows an explicit outtype."""
    kvs = []
    for item in base.kvs.values():
        if item.key == "general.file_type" and target is not None:
            item = item._replace(value=FILE_TYPE[target])
        kvs.append(item)
    if target is not None and "general.file_type" not in base.kvs:
        kvs.append(kv("general.file_type", FILE_TYPE[target]))
    return kvs
