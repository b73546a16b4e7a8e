"""Where a training step's time goes, by phase: every matmul, dequantization, each
kernel, the LoRA products, Python glue. For the benchmarks only.

`instrument(graph)` times one Graph instance (no module is patched): it gives the
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


def profile_steps(graph, params, inputs, targets, weights, first: int, opts, clock=time.perf_counter,
                  n: int = 3) -> str:
    """`n` training steps of `graph` (iterations first, first + 1, ...; the optimizer
    update included) split into phases: `table` of them. Instruments `graph`."""
    from llamatune.train.optimizer import optimizer_step
    phases = Phases(clock)
    instrument(graph, phases)
    update = phases.timed("optimizer", optimizer_step)
    runs = []
    for i in range(first, first + n):
        phases.clear()
        t = clock()
        params.zero_grad()
        graph.step(inputs, targets, weights, (0, i, 0))
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


def instrument(graph, phases: Phases) -> None:
    """Time the phases of `graph`'s steps into `phases` (this instance only)."""
    def matmul_label():
        return "matmul head" if phases.inside("head") else "matmul layers"
    graph.xp = _Timed(graph.xp, lambda n, f: phases.timed(matmul_label, f) if n == "matmul" else f)
    graph.ops = SimpleNamespace(**{
        op: _Timed(mod, lambda n, f, op=op: phases.timed(f"{op}.{n}", f))
        for op, mod in vars(graph.ops).items()})
    graph.base.matrix_rows = phases.timed("dequantize", graph.base.matrix_rows)
    graph.base.embed = phases.timed("embedding rows", graph.base.embed)
    graph._lora_backward = phases.timed("lora backward (@ products)", graph._lora_backward)
    graph.linear = phases.timed("linear glue (+bias, +lora)", graph.linear)
    graph.linear_backward = phases.timed("linear_backward glue", graph.linear_backward)
    graph._dropout_mask = phases.timed("dropout masks", graph._dropout_mask)
    graph._head = phases.timed("head", graph._head)
