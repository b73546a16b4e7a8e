"""A model ready to run: the GGUF loaded, the adapters applied at run time, on the
chosen device. The one place perplexity, generate, chat and the quickstart tour get
their `infer.Runner` from."""
from __future__ import annotations

from pathlib import Path

from ..backend import get_backend, set_tf32
from ..formats.tensors import NonFiniteError
from ..precision import policy
from .infer import Runner
from .model import Model


def make_runner(model_path: Path, adapters: list[tuple[str, float]] = (), device: str = "cpu",
                allow_nonfinite: bool = False, compute_dtype: str = "f32") -> Runner:
    """`adapters`: (GGUF adapter path, user scale) pairs; `compute_dtype` as --compute-dtype,
    resolved here into the runner's ComputePolicy (`runner.policy.why` says why)."""
    backend = get_backend(device)
    compute = policy(compute_dtype, backend.name)     # no capability: auto is f32 on a GPU (the CPU's digits)
    set_tf32(backend.xp, compute.tensor_cores)        # a GPU's float32 products (nothing on numpy)
    try:
        model = Model(model_path, allow_nonfinite)
        loaded = None
        if adapters:
            from ..formats.adapter import load_runtime_adapters
            loaded = load_runtime_adapters(model, list(adapters), allow_nonfinite)
    except NonFiniteError as e:
        raise NonFiniteError(f"{e} (--allow-nonfinite runs anyway)") from None
    return Runner(model, loaded, backend, compute)


def runner_for(o) -> Runner:
    """The runner a command's RunOptions ask for (--model, --lora, --lora-scaled, --device,
    --allow-nonfinite)."""
    from ..options import scaled_adapters
    return make_runner(o.model, [(str(p), 1.0) for p in o.lora] + scaled_adapters(o.lora_scaled), o.device,
                       o.allow_nonfinite, o.compute_dtype)
