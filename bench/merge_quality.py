"""How much of an adapter survives a merge into a quantized model (#31; llama.cpp #13485).

For each base type: (a) the adapter at run time, (b) the plain merge (round to
nearest), (c) the compensated merge (llamatune export-lora with --calibration-data;
and, when the adapter has the imatrix finetune wrote beside it, with that alone:
"compensated-training-imatrix"), (d) llama-export-lora's F16 merge re-quantized by
llama-quantize, without and with an imatrix (the one llamatune collected from
--calibration; only where a llama.cpp build is given); with --merge-aware-adapter
also the plain merge of an adapter trained with --merge-aware on the same data
("merge-aware-plain"). Each is scored on held-out text with llama-perplexity's
protocol (windows of --ctx tokens, BOS first, the second half scored), by llamatune's
forward (llama-perplexity itself is not run: the local build dies with "Illegal
instruction"; llamatune's perplexity agrees with it within 0.1 %):

  ppl            perplexity
  KL shift kept  1 - KLD(adapter || X) / KLD(adapter || base): how much of the way from
                 the base to the run-time adapter's distribution X goes (1 = all of it)
  same top       share of scored tokens whose most likely next token is the adapter's
  gain kept      (ppl_base - ppl_X) / (ppl_base - ppl_adapter)

Usage (the base files are made once in --workdir):
  python bench/merge_quality.py --model MODEL.gguf --adapter ADAPTER.gguf \
      --eval shakespeare-eval.txt --calibration shakespeare.txt --types q4_k_m,q4_0,q8_0 \
      [--bases q8_0=MODEL-Q8_0.gguf] [--llamacpp /path/to/llama.cpp/build/bin] [--windows 16] [--ctx 256]
  python bench/merge_quality.py ... --time-shapes 4096x11008,11008x4096   (quantizer timings only)

The issue's full table on the real model (Q4_K_M as shipped, Q4_0 and Q8_0 made by
llama-quantize): train the two adapters, then
  python bench/merge_quality.py --model qwen2.5-coder-0.5b-instruct.gguf --adapter run/adapter-LATEST.gguf \
      --merge-aware-adapter run-ma/adapter-LATEST.gguf --eval shakespeare-eval.txt \
      --calibration shakespeare.txt --types q4_k_m,q4_0,q8_0 --llamacpp llama.cpp/build/bin
The merge-aware adapter is trained on one base type (its --model-base); its merge is
scored on that type only (the others would merge it into a base it was not trained on:
give the type with --merge-aware-type, default q4_k_m).

`q4_k_m` means MODEL as given when its general.file_type is 15 (MOSTLY_Q4_K_M); other
types are made from MODEL by llama-quantize --allow-requantize where a build is given,
else by llamatune (every matrix re-quantized to the type, 1-D tensors F32).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llamatune.commands.export import export_lora
from llamatune.commands.perplexity import make_windows
from llamatune.formats.adapter import load_runtime_adapters
from llamatune.formats.gguf_io import GGUFFile, TensorOut, write_gguf
from llamatune.formats.imatrix import beside
from llamatune.kernels.dequant import dequantize
from llamatune.kernels.quantize import quantize
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.models.writer import FILE_TYPE, fit_type
from llamatune.options import MergeOptions
from gguf import GGMLQuantizationType as QType


def make_base(model: Path, qtype: str, work: Path, llamacpp: Path | None) -> Path:
    """MODEL re-quantized to qtype (cached in work)."""
    if qtype == "q4_k_m" and GGUFFile(model).get("general.file_type") == 15:
        return model
    out = work / f"base-{qtype}.gguf"
    if out.exists():
        return out
    if llamacpp is not None:
        subprocess.run([str(llamacpp / "llama-quantize"), "--allow-requantize", str(model), str(out),
                        qtype.upper()], check=True, capture_output=True)
        return out
    f = GGUFFile(model)
    target = QType[qtype.upper()]
    tensors = []
    for t in f.tensors.values():
        qt = QType.F32 if len(t.shape) == 1 else fit_type(t.n_cols, target)
        w = dequantize(t.raw_rows(), t.qtype, t.n_cols)
        data = w.reshape(t.shape) if qt == QType.F32 else quantize(w, qt)
        tensors.append(TensorOut(t.name, t.shape, qt, lambda d=data: d))
    kvs = [kv._replace(value=FILE_TYPE[target]) if kv.key == "general.file_type" else kv for kv in f.kvs.values()]
    write_gguf(out, f.arch, kvs, tensors)
    return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def score(runners: dict[str, Runner], reference: str, windows: np.ndarray) -> dict[str, dict]:
    """ppl of every runner, and KLD / same-top against runners[reference], window by window."""
    n_ctx = windows.shape[1]
    first = n_ctx // 2
    acc = {k: dict(nll=0.0, kld=0.0, top=0, n=0) for k in runners}
    for w in windows:
        targets = w[first + 1:]
        ref = None
        for name in [reference] + [k for k in runners if k != reference]:
            lp = log_softmax(runners[name].forward(w[None])[0, first:n_ctx - 1])
            a = acc[name]
            a["nll"] -= float(lp[np.arange(len(targets)), targets].sum())
            a["n"] += len(targets)
            if ref is None:
                ref = lp
            a["kld"] += float((np.exp(ref) * (ref - lp)).sum())
            a["top"] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
    return {k: dict(ppl=float(np.exp(a["nll"] / a["n"])), kld=a["kld"] / a["n"], top=a["top"] / a["n"])
            for k, a in acc.items()}


def time_shape(n_out: int, n_in: int, qtype: QType, block: int = 0, repeats: int = 2) -> dict[str, float]:
    """Seconds for one (n_out, n_in) matrix: plain quantize, inverse_cholesky(H) (of its
    diagonal blocks of `block` columns, as export-lora's --calibration-block; 0: whole),
    quantize_compensated; the fastest of `repeats`, the runs alternated."""
    from llamatune.kernels.compensate import inverse_cholesky, quantize_compensated
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n_out, n_in)) * 0.02).astype(np.float32)
    x = rng.standard_normal((2 * n_in, n_in)).astype(np.float32)
    h = (x.T @ x / len(x)).astype(np.float64)
    qw = np.diagonal(h).astype(np.float32)
    best = {"plain": np.inf, "factor": np.inf, "compensated": np.inf}
    quantize(w[:8], qtype), quantize_compensated(w[:8, :512], qtype, np.eye(512), qw[:512])   # compile
    for _ in range(repeats):
        t0 = time.perf_counter()
        quantize(w, qtype)
        t1 = time.perf_counter()
        hb = h if not 0 < block < n_in else [h[a:a + block, a:a + block] for a in range(0, n_in, block)]
        u = inverse_cholesky(hb, dtype=np.float32)          # as export-lora factors
        t2 = time.perf_counter()
        quantize_compensated(w, qtype, u, qw)
        t3 = time.perf_counter()
        for k, v in (("plain", t1 - t0), ("factor", t2 - t1), ("compensated", t3 - t2)):
            best[k] = min(best[k], v)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, required=True)
    ap.add_argument("--eval", type=Path, required=True)
    ap.add_argument("--calibration", type=Path, required=True)
    ap.add_argument("--types", default="q4_k_m,q4_0,q8_0")
    ap.add_argument("--bases", default="", help="TYPE=FILE[,TYPE=FILE]: ready base files (e.g. made by "
                    "llama-quantize) instead of re-quantizing --model")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-merge-quality"))
    ap.add_argument("--llamacpp", type=Path, default=None, help="llama.cpp build/bin (for (d))")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16, help="eval windows (the text's first ones)")
    defaults = MergeOptions()
    ap.add_argument("--calibration-ctx", type=int, default=defaults.calibration_ctx)
    ap.add_argument("--calibration-chunks", type=int, default=defaults.calibration_chunks)
    ap.add_argument("--calibration-block", type=int, default=defaults.calibration_block)
    ap.add_argument("--calibration-memory", type=int, default=defaults.calibration_memory)
    ap.add_argument("--merge-aware-adapter", type=Path, default=None,
                    help="an adapter finetune --merge-aware trained on the --merge-aware-type base")
    ap.add_argument("--merge-aware-type", default="q4_k_m")
    ap.add_argument("--time-shapes", default="", help="only time the quantizers on OUTxIN[,OUTxIN...] "
                    "matrices (Q4_K), e.g. 4096x11008 for a 7B ffn_down")
    args = ap.parse_args()
    if args.time_shapes:
        for shape in args.time_shapes.split(","):
            n_out, n_in = map(int, shape.split("x"))
            qtype = QType.Q4_K if n_in % 256 == 0 else QType.Q4_0
            times = time_shape(n_out, n_in, qtype, args.calibration_block)
            print(shape, qtype.name, {k: round(v, 2) for k, v in times.items()}, flush=True)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for qtype in args.types.split(","):
        given = dict(item.split("=", 1) for item in args.bases.split(",") if item)
        base = Path(given[qtype]) if qtype in given else make_base(args.model, qtype, args.workdir, args.llamacpp)
        files, times = {}, {}
        for method in ("plain", "compensated"):
            out = args.workdir / f"merged-{qtype}-{method}.gguf"
            opts = MergeOptions(merge_method=method)
            if method == "compensated":
                opts = MergeOptions(calibration_data=args.calibration, calibration_ctx=args.calibration_ctx,
                                    calibration_chunks=args.calibration_chunks,
                                    calibration_block=args.calibration_block,
                                    calibration_memory=args.calibration_memory,
                                    imatrix_out=args.workdir / f"imatrix-{qtype}.gguf")
            t0 = time.perf_counter()
            export_lora(base, [(args.adapter, 1.0)], out, merge=opts)
            times[method] = time.perf_counter() - t0
            files[method] = out
            print(f"{qtype} {method}: export {times[method]:.1f} s", flush=True)
        if beside(args.adapter).is_file():           # export-lora's default: the finetune's imatrix
            out = args.workdir / f"merged-{qtype}-compensated-training-imatrix.gguf"
            t0 = time.perf_counter()
            export_lora(base, [(args.adapter, 1.0)], out, merge=MergeOptions())
            times["compensated-training-imatrix"] = time.perf_counter() - t0
            files["compensated-training-imatrix"] = out
        if args.merge_aware_adapter is not None and qtype == args.merge_aware_type:
            out = args.workdir / f"merged-{qtype}-merge-aware-plain.gguf"
            export_lora(base, [(args.merge_aware_adapter, 1.0)], out, merge=MergeOptions(merge_method="plain"))
            files["merge-aware-plain"] = out
        if args.llamacpp is not None:
            f16 = args.workdir / f"merged-{qtype}-f16.gguf"
            subprocess.run([str(args.llamacpp / "llama-export-lora"), "-m", str(base), "--lora", str(args.adapter),
                            "-o", str(f16)], check=True, capture_output=True)
            target = "Q4_K_M" if qtype == "q4_k_m" else qtype.upper()
            for tag, extra in (("llama-quantize", []),
                               ("llama-quantize-imatrix", ["--imatrix", str(args.workdir / f"imatrix-{qtype}.gguf")])):
                out = args.workdir / f"merged-{qtype}-{tag}.gguf"
                subprocess.run([str(args.llamacpp / "llama-quantize"), "--allow-requantize", *extra, str(f16),
                                str(out), target],
                               check=True, capture_output=True)
                files[tag] = out
        model = Model(base)
        runners = {"base": Runner(model),
                   "adapter": Runner(model, load_runtime_adapters(model, [(str(args.adapter), 1.0)]))}
        runners.update({k: Runner(Model(p)) for k, p in files.items()})
        tok = model.tokenizer
        windows = make_windows(tok.encode(args.eval.read_text(encoding="utf-8"), add_special=True), args.ctx,
                               tok.bos_id, tok.add_bos, str(args.eval))[: args.windows]
        t0 = time.perf_counter()
        s = score(runners, "adapter", windows)
        print(f"{qtype}: scored {len(windows)} windows in {time.perf_counter() - t0:.0f} s", flush=True)
        gain = s["base"]["ppl"] - s["adapter"]["ppl"]
        for k, v in s.items():
            v["kl_shift_kept"] = 1 - v["kld"] / s["base"]["kld"] if k != "adapter" else 1.0
            v["gain_kept"] = (s["base"]["ppl"] - v["ppl"]) / gain if gain else float("nan")
            v["export_s"] = times.get(k)
        results[qtype] = s
        print(f"\n| {qtype} | ppl | KL shift kept | same top token | gain kept | export s |\n|---|---|---|---|---|---|")
        for k, v in s.items():
            export_s = "" if v["export_s"] is None else f"{v['export_s']:.0f}"
            print(f"| {k} | {v['ppl']:.2f} | {100 * v['kl_shift_kept']:.1f} % | {100 * v['top']:.1f} % | "
                  f"{100 * v['gain_kept']:.1f} % | {export_s} |", flush=True)
    (args.workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
