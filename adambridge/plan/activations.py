"""The activation estimate: the bytes a decoder's forward keeps for its backward, per token,
counted tensor by tensor as Korthikanti et al. count them ("Reducing Activation Recomputation
in Large Transformer Models", 2022, https://arxiv.org/abs/2205.05198, section 4), for the
layers transformers builds: bf16 weights, SDPA attention, the loss in fp32.

The paper's GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes: the 5·a·s/h part is the attention
scores (softmax, its dropout mask and output), which SDPA and flash attention never store
(they keep the output and one fp32 log-sum-exp per head and token, and recompute the rest).
docs/planning.md lists every term; tests/plan/test_plan_memory.py checks the totals against
transformers' Llama, Qwen2 and GPT-2 on the CPU.
"""
from __future__ import annotations

from typing import Optional

from .shapes import Shape

# The loss: transformers upcasts the logits to fp32; log_softmax keeps its fp32 output for
# backward (4 B per vocabulary entry and token), and the first step of backward adds the
# fp32 gradients into and out of log_softmax (4 + 4) while the bf16 logits (2) are still
# held by the model's output: 10 B per vocabulary entry and token, for a moment.
LOSS_SAVED_BYTES = 4
LOSS_TRANSIENT_BYTES = 10


def layer_bytes(shape: Shape) -> float:
    """Bytes one decoder layer keeps for backward, per token (SDPA attention).

    Llama-style: each RMSNorm keeps its fp32 input (4h), the fp32 reciprocal root (4), the
    normalised bf16 tensor (2h) and the scaled one the next linear reads (2h): 2 x (8h + 4);
    attention keeps Q (2ad), K and V (2·2kd), its output (2ad) and the log-sum-exp (4a);
    the gated MLP keeps the gate's output, its SiLU, the up projection and their product
    (4 x 2I). GPT-2: two LayerNorms' inputs (2 x 2h) and statistics (2 x 4), the inputs of
    c_attn, c_proj, c_fc (3 x 2h), the packed QKV (6h), Q's copy and the output (2 x 2h), the
    log-sum-exp (4a), and the MLP's c_fc output, the four tensors of gelu_new's tanh formula
    and c_proj's input (5 x 2I); with residual dropout, two 1-byte masks (2h).
    """
    h, a, d, k, inner = shape.hidden, shape.heads, shape.head_dim, shape.kv_heads, shape.intermediate
    if shape.family == "gpt2":
        masks = 2 * h if shape.dropout > 0 else 0
        return 20 * h + 10 * inner + 4 * a + 8 + masks
    return 2 * (8 * h + 4) + 4 * a * d + 4 * k * d + 4 * a + 8 * inner


def output_bytes(shape: Shape) -> float:
    """Bytes kept outside the layers, per token: the final norm's (Llama-style: as a layer's
    norm, its scaled output being lm_head's input; GPT-2: its input and statistics, 2h + 4,
    and lm_head's input, 2h), the input ids and labels (int64: 16), the loss's fp32
    log-probabilities (4V); GPT-2 with dropout: the embedding's mask (h)."""
    h = shape.hidden
    if shape.family == "gpt2":
        norm = 4 * h + 4 + (h if shape.dropout > 0 else 0)
    else:
        norm = 8 * h + 4
    return norm + 16 + LOSS_SAVED_BYTES * shape.vocab


def backward_transient_bytes(shape: Shape) -> float:
    """Gradients alive while one layer's backward runs, per token: at most two of its widest
    tensors' (2 x 2I) and two of its input's (2 x 2h)."""
    return 4 * shape.intermediate + 4 * shape.hidden


def peak_bytes_per_token(shape: Shape, checkpointing: bool) -> float:
    """The activations at their peak, per token.

    Without checkpointing the peak is at the start of backward: every layer's tensors, the
    output's, and the larger of the loss's moment and one layer's backward. With
    transformers' activation checkpointing (one region per decoder layer) a layer keeps only
    its input (2h) and the one being recomputed holds its whole set during its backward.
    """
    loss = LOSS_TRANSIENT_BYTES * shape.vocab
    layer, transient = layer_bytes(shape), backward_transient_bytes(shape)
    if checkpointing:
        return shape.layers * 2 * shape.hidden + output_bytes(shape) + max(loss, layer + transient)
    return shape.layers * layer + output_bytes(shape) + max(loss, transient)


def activation_bytes(shape: Optional[Shape], tokens_per_pass: float,
                     checkpointing: bool) -> Optional[float]:
    """Bytes of activations at the peak of one backward pass of ``tokens_per_pass`` tokens
    (batch x sequence), or None without a shape."""
    if shape is None:
        return None
    return tokens_per_pass * peak_bytes_per_token(shape, checkpointing)
