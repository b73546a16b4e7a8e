"""Where a training step's time goes, by phase: every matmul, dequantization, each
kernel, the LoRA products, Python glue. For the benchmarks only.

`instrument(graph)` times one StepExecutor instance (no module is patched): it gives the
graph an `xp` whose `matmul` is timed, an `ops` whose kernel functions are timed,
and timed bound methods for the dequantization (`base.matrix_rows`) and the LoRA
backward. Times are exclusive (a phase's own time, its timed callees subtracted),
so they add up to the step; a matmul inside the output head is counted apart.
On a GPU, give `Phases` a clock that synchronizes the device before reading the time
(`device_clock`): each phase is then its kernels' time plus their launches.
"""
from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace


class Phases:
    """Exclusive wall seconds and calls per label."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock                      # perf_counter, or process_time for CPU seconds
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []            # [label, seconds of timed callees]

    def timed(self, label, fn):
        def call(*args, **kwargs):
            name = label() if callable(label) else label
            self._stack.append([name, 0.0])
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = self.clock() - t
                _, inner = self._stack.pop()
                self.seconds[name] += spent - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][1] += spent
        return call

    def inside(self, label: str) -> bool:
        return any(name == label for name, _ in self._stack)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()



def table(runs: list[tuple[float, dict, dict]]) -> str:
    """Phases of several timed steps [(step seconds, seconds by phase, calls by phase)]:
    each phase's least time over the steps (the least disturbed by other processes on a
    shared machine), its share of the fastest step."""
    total = min(r[0] for r in runs)
    best = {name: min(r[1].get(name, 0.0) for r in runs) for name in runs[0][1]}
    lines = [f"{'phase':36} {'calls':>6} {'seconds':>8} {'share':>6}"]
    for name, s in sorted(best.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:36} {runs[0][2][name]:6d} {s:8.3f} {s / total:6.1%}")
    rest = total - sum(best.values())
    lines.append(f"{'(rest: step glue, disturbance)':36} {'':6} {rest:8.3f} {rest / total:6.1%}")
    lines.append(f"{'step (fastest of ' + str(len(runs)) + ')':36} {'':6} {total:8.3f}")
    return "\n".join(lines)


def profile_steps(executor, params, inputs, targets, weights, first: int, opts, clock=time.perf_counter,
                  n: int = 3) -> str:
    """`n` training steps of `graph` (iterations first, first + 1, ...; the optimizer
    update included) split into phases: `table` of them. Instruments `graph`."""
    from llamatune.train.optimizer import optimizer_step
    phases = Phases(clock)
    instrument(executor, phases)
    update = phases.timed("optimizer", optimizer_step)
    runs = []
    for i in range(first, first + n):
        phases.clear()
        t = clock()
        params.zero_grad()
        executor.step(inputs, targets, weights, (0, i, 0))
        update(params, i, opts)
        runs.append((clock() - t, dict(phases.seconds), dict(phases.calls)))
    return table(runs)


def device_clock(synchronize):
    """perf_counter read after `synchronize()` (the device's queued work done)."""
    def clock() -> float:
        synchronize()
        return time.perf_counter()
    return clock


class _Timed:
    """A module (numpy or a kernel module) whose chosen functions are timed."""

    def __init__(self, module, wrap):
        self._module, self._wrap, self._cache = module, wrap, {}

    def __getattr__(self, name):
        a = getattr(self._module, name)
        if not callable(a) or isinstance(a, type):
            return a
        if name not in self._cache:
            self._cache[name] = self._wrap(name, a)
        return self._cache[name]


def instrument(executor, phases: Phases) -> None:
    """Time the phases of `graph`'s steps into `phases` (this instance only)."""
    def matmul_label():
        return "matmul head" if phases.inside("head") else "matmul layers"
    executor.xp = _Timed(executor.xp, lambda n, f: phases.timed(matmul_label, f) if n == "matmul" else f)
    executor.ops = SimpleNamespace(**{
        op: _Timed(mod, lambda n, f, op=op: phases.timed(f"{op}.{n}", f))
        for op, mod in vars(executor.ops).items()})
    executor.weights.matrix_rows = phases.timed("dequantize", executor.weights.matrix_rows)
    executor.weights.embed = phases.timed("embedding rows", executor.weights.embed)
    linears = executor.linears
    linears.lora_backward = phases.timed("lora backward (@ products)", linears.lora_backward)
    executor.linear = phases.timed("linear glue (+bias, +lora)", executor.linear)
    linears.backward = phases.timed("linear_backward glue", linears.backward)
    linears.dropout_mask = phases.timed("dropout masks", linears.dropout_mask)
    executor.head.loss = phases.timed("head", executor.head.loss)


def _operand(a) -> tuple:
    """What a product's speed depends on: shape, element strides, dtype."""
    return a.shape, tuple(s // a.itemsize for s in a.strides), a.dtype.str


def _rebuild(sig, rng):
    """A random array laid out as `sig` (_operand), over a buffer of its own."""
    import numpy as np
    shape, strides, dtype = sig
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    buf = rng.random(size).astype(dtype)
    return np.lib.stride_tricks.as_strided(buf, shape, tuple(s * buf.itemsize for s in strides))


def product_bound(executor, params, inputs, targets, weights, it: int, opts, repeat: int = 10):
    """Every matmul product of one training step (executor.xp.matmul and the LoRA
    backward's `@` products; not attention's, which are inside its kernel), timed
    where it runs in the step and again alone: each distinct (shape, layout) replayed
    on fresh arrays, the best of `repeat` runs, with its operands hot in cache.
    Returns [(group, calls, flops, seconds in the step, seconds alone)] for the
    groups "layers", "head" and "lora backward"."""
    import numpy as np
    from collections import Counter
    from llamatune.train.optimizer import optimizer_step
    calls: Counter = Counter()
    in_step: dict[str, float] = defaultdict(float)
    where = ["layers"]

    def record(group, a, b, out=None):
        calls[(group, _operand(a), _operand(b), None if out is None else _operand(out))] += 1

    xp = executor.xp

    def matmul(a, b, out=None):
        record(where[0], a, b, out)
        t = time.perf_counter()
        r = xp.matmul(a, b, out=out)
        if where[0] != "lora backward":                 # that group is timed as a whole
            in_step[where[0]] += time.perf_counter() - t
        return r
    lora_backward, head = executor.linears.lora_backward, executor.head.loss

    def lora(t, dy, xd, xa, dx, mask=None):            # its three `@` products, then the call
        r = xa.shape[1]
        dxa = np.empty((dy.shape[0], r), dy.dtype)
        for a, b in ((dy.T, xa), (dy, params[t.b]), (xd.T, dxa)):
            record("lora backward", a, b)
        outer, where[0] = where[0], "lora backward"
        tm = time.perf_counter()
        lora_backward(t, dy, xd, xa, dx, mask)
        in_step["lora backward"] += time.perf_counter() - tm
        where[0] = outer

    def in_head(*args, **kwargs):
        where[0] = "head"
        try:
            return head(*args, **kwargs)
        finally:
            where[0] = "layers"
    executor.xp = _Timed(xp, lambda name, f: matmul if name == "matmul" else f)
    executor.linears.lora_backward, executor.head.loss = lora, in_head
    try:
        params.zero_grad()
        executor.step(inputs, targets, weights, (0, it, 0))
        optimizer_step(params, it, opts)
    finally:
        executor.xp = xp
        del executor.linears.lora_backward, executor.head.loss
    rng = np.random.default_rng(0)
    alone: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    n: dict[str, int] = defaultdict(int)
    for (group, sa, sb, so), count in calls.items():
        a, b = _rebuild(sa, rng), _rebuild(sb, rng)
        out = None if so is None else _rebuild(so, rng)
        np.matmul(a, b, out=out)
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            np.matmul(a, b, out=out)
            best = min(best, time.perf_counter() - t)
        alone[group] += count * best
        flops[group] += count * 2 * a.shape[0] * a.shape[1] * b.shape[1]
        n[group] += count
    return [(g, n[g], flops[g], in_step[g], alone[g]) for g in ("layers", "head", "lora backward") if n[g]]
