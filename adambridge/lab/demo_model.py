"""The demo's model and data: a small byte-level GPT and the standard library's source as text.

Nothing here downloads anything. The corpus is the running interpreter's own standard library
(every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, site-packages excluded) or a
file the user names; tokens are its bytes, so the vocabulary is 256.
"""
from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ---------------------------------------------------------------------------- data

def stdlib_sources() -> list[Path]:
    """Every .py file of the standard library, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    return files


def load_corpus(text_file: Optional[str] = None, max_bytes: int = 1 << 62) -> tuple[torch.Tensor, str]:
    """The demo's text as a uint8 tensor of byte tokens, and a line saying where it came from."""
    if text_file is not None:
        data = Path(text_file).read_bytes()[:max_bytes]
        source = f"{text_file} ({len(data):,} bytes)"
    else:
        files, parts, size = stdlib_sources(), [], 0
        for path in files:
            if size >= max_bytes:
                break
            try:
                parts.append(path.read_bytes())
            except OSError:
                continue  # an unreadable file: the corpus is still deterministic per machine
            size += len(parts[-1])
        data = b"\n".join(parts)[:max_bytes]
        source = (f"Python {sysconfig.get_python_version()} standard library source "
                  f"({len(parts)} files, {len(data):,} bytes)")
    if not data:
        raise ValueError(f"The demo text is empty: {text_file or 'standard library'}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), source


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.1,
                 block: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation tokens: every k-th block of the text is held out (k = 1/val_fraction).

    Blocks, not a tail, so validation samples the whole text; the block shrinks for short texts
    so that each split still gets several blocks.
    """
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"Invalid val_fraction: {val_fraction}")
    every = round(1.0 / val_fraction)
    block = max(1, min(block, len(tokens) // (4 * every)))
    blocks = torch.split(tokens, block)
    val = [b for i, b in enumerate(blocks) if i % every == every - 1]
    train = [b for i, b in enumerate(blocks) if i % every != every - 1]
    if not val or not train:
        raise ValueError(f"The text is too short to split: {len(tokens)} bytes")
    return torch.cat(train), torch.cat(val)


def batch_starts(n_tokens: int, ctx: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """The start offset of every sequence of every step, (steps, batch): one data order per seed."""
    if n_tokens <= ctx + 1:
        raise ValueError(f"The training text ({n_tokens} bytes) is shorter than one sequence ({ctx + 1})")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - ctx - 1, (steps, batch), generator=gen)


def gather(tokens: torch.Tensor, starts: torch.Tensor, ctx: int) -> torch.Tensor:
    """Sequences of ctx + 1 tokens (inputs and shifted targets) beginning at each start."""
    return tokens[starts.unsqueeze(-1) + torch.arange(ctx + 1)].long()


def val_windows(val: torch.Tensor, ctx: int, count: int) -> torch.Tensor:
    """Up to `count` non-overlapping validation sequences, evenly spread over the split."""
    n = (len(val) - 1) // ctx
    if n < 1:
        raise ValueError(f"The validation split ({len(val)} bytes) is shorter than one sequence")
    picks = torch.linspace(0, n - 1, min(n, count)).round().long().unique()
    return gather(val, picks * ctx, ctx)


# ---------------------------------------------------------------------------- model

class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = _linear(self.qkv, _norm(self.ln1, x, dtype), dtype).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(self.proj, y.transpose(1, 2).reshape(B, T, C), dtype)
        return x + _linear(self.out, F.gelu(_linear(self.fc, _norm(self.ln2, x, dtype), dtype)), dtype)


class TinyGPT(nn.Module):
    """A GPT-2-style byte-level language model with tied input and output embeddings.

    The weights may be stored in any dtype; `compute_dtype` is the dtype they are cast to
    when used. On a CPU without bf16 arithmetic the demo stores bf16 weights (as a GPU
    would) but computes in fp32, which is faster there and changes nothing about how
    the stored weights are updated.
    """

    def __init__(self, width: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.compute_dtype = torch.float32
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(ctx, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        # NOTE: GPT-2's initialisation; residual projections scaled by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue  # LayerNorm weights stay 1, biases 0
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        wte = self.wte.weight.to(dtype)
        x = F.embedding(idx, wte) + self.wpe.weight[: idx.shape[1]].to(dtype)
        for block in self.blocks:
            x = block(x, dtype)
        return _norm(self.ln_f, x, dtype) @ wte.t()


def _linear(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.linear(x, layer.weight.to(dtype), layer.bias.to(dtype))


def _norm(layer: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.layer_norm(x, layer.normalized_shape, layer.weight.to(dtype), layer.bias.to(dtype))


def lm_loss(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats), computed in fp32 whatever the model's dtype."""
    logits = model(seqs[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), seqs[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean validation loss over all windows."""
    total = 0.0
    for chunk in torch.split(windows, batch):
        total += lm_loss(model, chunk.to(device)).item() * len(chunk)
    return total / len(windows)


def bf16_changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Fraction of all weights whose bf16-rounded value differs between two state dicts."""
    changed = total = 0
    for name, b in before.items():
        a = after[name]
        changed += (b.to(torch.bfloat16) != a.detach().to("cpu", torch.bfloat16)).sum().item()
        total += b.numel()
    return changed / total


def below_half_ulp_fraction(state: dict[str, torch.Tensor], step: float) -> float:
    """Fraction of weights for which an update of `step` is below half their bf16 spacing.

    Such an update rounds away when the weights are stored in bf16 without an fp32 master.
    """
    below = total = 0
    for w in state.values():
        w = w.detach().to("cpu", torch.bfloat16).float().abs()
        _, exponent = torch.frexp(w)  # w = mantissa * 2**exponent, mantissa in [0.5, 1)
        half_ulp = torch.ldexp(torch.ones_like(w), exponent - 9)  # bf16: 8 significant bits
        below += ((w > 0) & (step < half_ulp)).sum().item()
        total += w.numel()
    return below / total
