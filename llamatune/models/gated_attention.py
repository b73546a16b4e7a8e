"""What Qwen3.5's gated full-attention layers add to attention, forward and backward.

llama.cpp's `build_layer_attn` (src/models/qwen35.cpp) and HF's Qwen3_5Attention:
`attn_q` (2 NH HS, C) gives, per head, HS query rows then HS gate rows (views of one
product: `split_q_gate`; their gradients join back into one dy: `join_q_gate`); the
query goes on through the per-head q norm, rope and attention as qwen3's; the
attention output (N, NH HS) is multiplied by sigmoid(gate) before `attn_output`
(`output_gate_forward` / `_backward`). Rope turns the first n_rot dimensions of each
head (partial rotary), as the rope kernel does for any n_rot <= head_dim.
"""
from __future__ import annotations

import numpy as np


def split_q_gate(qg: np.ndarray, NH: int, HS: int) -> tuple[np.ndarray, np.ndarray]:
    """q, gate (N, NH HS), contiguous, from the attn_q product qg (N, 2 NH HS)."""
    per_head = qg.reshape(-1, NH, 2, HS)
    return (np.ascontiguousarray(per_head[:, :, 0]).reshape(-1, NH * HS),
            np.ascontiguousarray(per_head[:, :, 1]).reshape(-1, NH * HS))


def join_q_gate(dqg: np.ndarray, dq: np.ndarray, dgate: np.ndarray, NH: int, HS: int) -> None:
    """dqg (N, 2 NH HS) overwritten with the gradients of split_q_gate's two views."""
    per_head = dqg.reshape(-1, NH, 2, HS)
    per_head[:, :, 0] = dq.reshape(-1, NH, HS)
    per_head[:, :, 1] = dgate.reshape(-1, NH, HS)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def output_gate_forward(out: np.ndarray, att: np.ndarray, gate: np.ndarray) -> None:
    """out = att * sigmoid(gate), all (N, NH HS); out may be att."""
    np.multiply(att, _sigmoid(gate), out=out)


def output_gate_backward(datt: np.ndarray, dgate: np.ndarray, dout: np.ndarray, att: np.ndarray,
                         gate: np.ndarray) -> None:
    """datt, dgate overwritten: datt = dout s, dgate = dout att s (1 - s), s = sigmoid(gate)."""
    s = _sigmoid(gate)
    np.multiply(dout, att * s * (1 - s), out=dgate)
    np.multiply(dout, s, out=datt)
