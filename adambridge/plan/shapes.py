"""What the GPU side of a plan needs beyond a parameter count: the decoder's layer shape (for
the activation estimate) and the sizes of the trainable parameters (for the gradients async
mode keeps on the device), read from a config.json, a transformers config or a built module.

Nothing here imports transformers: a config is a dict or any object with its attributes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

# The optimizer's default: a parameter under this many elements gets no hook and keeps its
# gradient on the device until step(), when the small ones move as one buffer per dtype.
SMALL_PARAM_THRESHOLD = 65536


@dataclass(frozen=True)
class Shape:
    """A decoder as the activation estimate sees it (docs/planning.md, "Activations")."""
    family: str           # "gpt2" (LayerNorm, GELU MLP) or "llama" (RMSNorm, gated MLP)
    hidden: int           # h
    layers: int           # L
    heads: int            # a
    kv_heads: int         # k (grouped-query attention: k < a)
    head_dim: int         # d
    intermediate: int     # I, the MLP's width
    vocab: int            # V
    dropout: float = 0.0  # GPT-2's residual dropout: each active one keeps a 1-byte mask


@dataclass(frozen=True)
class GradLayout:
    """The trainable parameters as async mode treats them: those with a hook (at least
    ``threshold`` elements), released one by one, and the small group held until step()."""
    threshold: int
    hooked: int         # elements of the parameters with a hook
    largest: int        # elements of the largest of them (0 when none)
    small: int          # elements of the small group
    small_params: int   # how many parameters the small group has
    assumed: str = ""   # "" when counted; else what was assumed for lack of the facts


def layout(numels: Iterable[int], threshold: int = SMALL_PARAM_THRESHOLD,
           assumed: str = "") -> GradLayout:
    """The GradLayout of trainable parameters of these element counts (empty ones go with
    the small group, as attach_hooks does)."""
    sizes = [int(n) for n in numels]
    hooked = [n for n in sizes if n > 0 and n >= threshold]
    small = [n for n in sizes if not (n > 0 and n >= threshold)]
    return GradLayout(threshold, sum(hooked), max(hooked, default=0), sum(small), len(small), assumed)


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def shape_of(config: Any) -> tuple[Optional[Shape], str]:
    """(the Shape of a decoder's config: a config.json dict or a transformers config object,
    "") or (None, why it has none)."""
    model_type = _get(config, "model_type") or "unknown"
    fields = dict(vocab=_get(config, "vocab_size"),
                  hidden=_get(config, "hidden_size", "n_embd", "d_model"),
                  layers=_get(config, "num_hidden_layers", "n_layer", "num_layers"),
                  heads=_get(config, "num_attention_heads", "n_head"))
    missing = [k for k, v in fields.items() if not isinstance(v, int) or v <= 0]
    if missing:
        return None, (f"the config (model_type {model_type!r}) gives no decoder shape "
                      f"({', '.join(missing)} missing)")
    hidden, heads = fields["hidden"], fields["heads"]
    if model_type == "gpt2":
        inner = _get(config, "n_inner") or 4 * hidden
        dropout = float(_get(config, "resid_pdrop") or 0.0)
        return Shape("gpt2", hidden, fields["layers"], heads, heads, hidden // heads, int(inner),
                     fields["vocab"], dropout), ""
    inner = _get(config, "intermediate_size")
    if not isinstance(inner, int):
        return None, f"the config (model_type {model_type!r}) gives no intermediate_size"
    kv = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or hidden // heads)
    return Shape("llama", hidden, fields["layers"], heads, kv, head_dim, inner,
                 fields["vocab"]), ""


@dataclass(frozen=True)
class ModuleCount:
    """A built nn.Module counted: every parameter once (tied ones too), the trainable ones'
    sizes, their dtypes, and its config's shape when it has one."""
    total: int
    trainable_numels: tuple
    dtypes: tuple
    shape: Optional[Shape]
    shape_note: str
    name: str


def count_module(model: Any) -> ModuleCount:
    """Count ``model``'s parameters (shared ones once) without touching their values."""
    seen, total, trainable, dtypes = set(), 0, [], set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        dtypes.add(str(p.dtype).replace("torch.", ""))
        if p.requires_grad:
            trainable.append(p.numel())
    config = getattr(model, "config", None)
    if config is None:
        shape, note = None, f"{type(model).__name__} has no .config"
    else:
        shape, note = shape_of(config)
    return ModuleCount(total, tuple(trainable), tuple(sorted(dtypes)), shape, note,
                       type(model).__name__)
