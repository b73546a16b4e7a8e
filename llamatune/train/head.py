"""The output head of training: final norm, logits, loss and their gradient, chunk by chunk.

The (N, V) logits never exist: tokens go through the head in chunks (buffers.head_chunk)
whose logits overlay the layer backward's idle scratch, and inside a chunk the head
W (V, C) is expanded `head_rows` rows at a time. Loss and logit gradient come from one
fused pass (`cross_entropy_forward_backward`). Only tokens with a target go through
the head. `LossHead` is held by train.step.StepExecutor (`StepExecutor.head`).
"""
from __future__ import annotations

import numpy as np

from .buffers import blocked_head, even_chunk


KEPT_HEAD_BLOCK = 4096  # vocabulary columns per product where the head's bf16 copy is kept whole: one chunk
#                         of 512 tokens (bench shape) 33-35 ms against 40 ms in blocks of the scratch's 1536
#                         rows; the blocked cross-entropy takes the same time at either width


class LossHead:
    """The loss head of a training graph (train.step.StepExecutor): it reads the graph's buffers
    (x_final, xn, dx, dxn, the logits chunk, losses), its linears (the head's adapter and
    gradients) and Forward.head_logits."""

    def __init__(self, executor):
        self.executor = executor

    def blocked_head(self, n: int, adapter, dW) -> bool:
        """Whether a chunk of n tokens goes through `_bf16_chunk` (`blocked_head`)."""
        executor = self.executor
        return (executor.policy.host_bf16 and executor.products.bf16_for(n)         # the CPU's blocked kernels
                and blocked_head(executor.cfg, adapter is not None, dW is not None))

    def bf16_head_width(self) -> int:
        """Vocabulary columns per product of `_bf16_chunk`: the dequantization scratch's
        head_rows, or KEPT_HEAD_BLOCK where the head's bf16 copy is kept whole."""
        executor = self.executor
        return max(executor.head_rows, KEPT_HEAD_BLOCK) if executor.weights.is_kept_bf16("output.weight") else executor.head_rows

    def _bf16_chunk(self, x, dx, losses, targets, weights, width, rows, backward: bool) -> None:
        """One chunk of the head with bf16 products (no adapter on the head, no soft-cap, the
        head frozen): each block's logits written contiguous, in column blocks
        (kernels/cross_entropy.py), the losses and the logit gradient from one pass over
        them, the gradient stored as bf16 over the logits: the operand of dx = g W as is,
        with no copy of the logits and no rounding pass."""
        executor = self.executor
        ce, n, V = executor.ops.cross_entropy, x.shape[0], executor.cfg.n_vocab
        logits = executor.logits.reshape(-1)[: n * V]
        blocks = [(lo, min(V, lo + width)) for lo in range(0, V, width)]
        with executor.products.shared_input(x):
            for vlo, vhi in blocks:
                executor.products(ce.column_block(logits, n, vlo, vhi), x, rows((vlo, vhi)), trans_b=True)
        ce.cross_entropy_blocked(losses, logits, width, targets, weights, grad=backward)
        if backward:
            self._dx_from_blocks(dx, blocks, rows, lambda lo, hi: ce.column_block_grad(logits, n, lo, hi))

    def _dx_from_blocks(self, dx, blocks, rows, grad_of, each=None) -> None:
        """dx = sum over the head's blocks of g W (g = grad_of(lo, hi), W = rows((lo, hi))),
        the block still expanded first; each(lo, hi, g) after a block's product."""
        executor = self.executor
        for j, (vlo, vhi) in enumerate(reversed(blocks)):
            g, W = grad_of(vlo, vhi), rows((vlo, vhi))
            if j == 0:
                executor.products(dx, g, W, trans_b=False)
            else:
                executor.products.add(dx, g, W, False, executor.linears.scratch(*dx.shape))
            if each is not None:
                each(vlo, vhi, g)

    def loss(self, targets: np.ndarray, weights: np.ndarray, backward: bool = True) -> float:
        """Output norm, logits, loss and (backward) the gradient back to the last layer's
        output (left in executor.dx), chunk by chunk of tokens; inside a chunk the head W (V, C)
        is expanded `head_rows` rows at a time, once for the logits and once for the
        gradient to the chunk's input (the block still expanded is used first).
        Only the tokens with a target (>= 0) go through the head: the others (prompts
        and padding of chat data, trained on answers only) have loss 0 and gradient 0,
        so their normed inputs are first gathered into the rows of executor.dx, idle until
        the norm's backward fills it, and their input gradients scattered back over
        zeros in executor.xn. Returns sum(weights * loss)."""
        executor = self.executor
        cfg, xp, N, V, C = executor.cfg, executor.xp, executor.N, executor.cfg.n_vocab, executor.cfg.n_embd
        wn = executor.linears.norm_weight("output_norm.weight")
        executor.ops.rmsnorm.rmsnorm_forward(executor.xn, executor.rstd_f, executor.x_final, wn, cfg.norm_eps)
        scored = xp.flatnonzero(targets >= 0)
        M = int(scored.shape[0])
        if M < N:                                            # compact: row k is token scored[k]
            xn, dxn, losses = executor.dx[:M], executor.dxn[:M], executor.losses[:M]
            xp.take(executor.xn, scored, axis=0, out=xn)
            targets, weights = targets[scored], weights[scored]
        else:
            xn, dxn, losses = executor.xn, executor.dxn, executor.losses
        chunk = even_chunk(M, executor.chunk)
        t = executor.linears.adapter("output.weight")
        target = executor.linears.weight_grad_to_write("output.weight") if backward else None
        dW, fresh = target if target is not None else (None, False)     # fresh: the first chunk writes it
        blocks = [(lo, min(V, lo + executor.head_rows)) for lo in range(0, V, executor.head_rows)]
        bf16_width = self.bf16_head_width()
        held = [None, None]                                  # (block, its expanded rows)

        def rows(block):
            if held[0] != block:
                held[:] = block, executor.weight_rows("output.weight", *block, M)
            return held[1]
        for lo in range(0, M, chunk):
            hi = min(M, lo + chunk)
            x, dx, part = xn[lo:hi], dxn[lo:hi], (losses[lo:hi], targets[lo:hi], weights[lo:hi])
            if self.blocked_head(hi - lo, t, dW):
                self._bf16_chunk(x, dx, *part, bf16_width, rows, backward)
                continue
            self._chunk(x, dx, *part, t, blocks, rows, dW, fresh, backward)
            fresh = False                                    # the first chunk wrote dW whole
        loss = float(xp.dot(losses.astype(np.float64), weights.astype(np.float64)))
        if M < N:                                            # the tokens without a target: loss 0
            kept = losses.copy()
            executor.losses.fill(0.0)
            executor.losses[scored] = kept
        if backward:
            if M < N:                                        # and gradient 0
                dxn = executor.xn
                dxn.fill(0.0)
                dxn[scored] = executor.dxn[:M]
            executor.dnorm.fill(0.0)
            executor.ops.rmsnorm.rmsnorm_backward(executor.dx, executor.dnorm, dxn, executor.x_final, wn, executor.rstd_f)
            executor.linears.norm_grad("output_norm.weight", executor.dnorm)
        return loss

    def _chunk(self, x, dx, losses, targets, weights, t, blocks, rows, dW, fresh: bool, backward: bool) -> None:
        """One chunk of n tokens of the head in the graph's products: logits block by block
        (plus the head's adapter t), the final soft-cap, the losses and (backward) the logit
        gradient in place, then dW (written whole when `fresh`, else added to) and dx."""
        executor = self.executor
        cfg, xp, C, n = executor.cfg, executor.xp, executor.cfg.n_embd, x.shape[0]
        logits = executor.logits[:n]
        xa = None if t is None else x @ t.a.T                # (n, r)
        executor.head_logits(logits, x, blocks, rows, [] if t is None else [(t.scale * xa, t.b)],
                          executor.linears.head_scratch)
        inv_scale = cfg.logit_multiplier(logits.dtype)
        if inv_scale is not None:                            # granite: logits / logit_scale, in place
            logits *= inv_scale
        if cfg.final_softcap:                                # cap * tanh(logits / cap), in place
            executor.ops.softcap.softcap_forward(logits, logits, cfg.final_softcap)
        if not backward:                                     # the step's kernel: the same losses bit for bit
            executor.ops.cross_entropy.cross_entropy_forward_backward(losses, logits, logits, targets, weights)
            return                                           # (the gradient dropped)
        if cfg.final_softcap:                                # d(capped) aside, then back through the cap
            dcap = executor.dlogits[:n]
            executor.ops.cross_entropy.cross_entropy_forward_backward(losses, dcap, logits, targets, weights)
            executor.ops.softcap.softcap_backward(logits, dcap, logits, cfg.final_softcap)
        else:
            executor.ops.cross_entropy.cross_entropy_forward_backward(losses, logits, logits, targets, weights)
        if inv_scale is not None:                            # back through the scale
            logits *= inv_scale
        weight_grad = None
        if dW is not None:                                   # the first chunk writes dW, the others add
            def weight_grad(vlo, vhi, g):
                if fresh:
                    xp.matmul(g.T, x, out=dW[vlo:vhi])
                else:
                    dW[vlo:vhi] += xp.matmul(g.T, x, out=executor.linears.head_scratch(vhi - vlo, C))
        self._dx_from_blocks(dx, blocks, rows, lambda vlo, vhi: logits[:, vlo:vhi], weight_grad)
        if t is not None:
            executor.linears.lora_backward(t, logits, x, xa, dx)

