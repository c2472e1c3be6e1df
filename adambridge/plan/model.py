"""How many parameters a plan counts: a given number, or a Hugging Face config.json counted
without weights (on the meta device through transformers, else by a decoder formula), and
how many of them train (a fraction, a count, or a LoRA adapter's parameters); with a config,
also the decoder's shape and each parameter's size (shapes.py), for the GPU side.

Nothing is downloaded and no remote code runs: the config is read from the file given and
only transformers' own classes are built, on the meta device (no memory, no weights).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from .errors import PlanError, invalid
from .shapes import SMALL_PARAM_THRESHOLD, GradLayout, Shape, layout, shape_of

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass(frozen=True)
class LinearLayer:
    """A weight matrix a LoRA adapter can target: its module name and shape."""
    name: str
    in_features: int
    out_features: int
    output: bool = False   # the output layer (lm_head), which peft's "all-linear" leaves out


@dataclass(frozen=True)
class ModelCount:
    """The parameters of a model as counted, and how."""
    total: int
    layers: tuple          # LinearLayer of every linear module; () when given as a number
    source: str
    numels: tuple = ()     # every parameter's elements (tied ones once); () when not known
    shape: Optional[Shape] = None
    shape_note: str = "a parameter count has no layer shape (give --model config.json)"


@dataclass(frozen=True)
class ModelFacts:
    """What a plan is for: all parameters, the trainable ones, and how each was found; the
    decoder's shape and the trainable parameters' sizes where a config or module told them."""
    total: int
    trainable: int
    source: str
    trainable_source: str
    shape: Optional[Shape] = None
    shape_note: str = ""
    grads: Optional[GradLayout] = None


def parse_count(name: str, value: Union[str, float, int]) -> float:
    """7e9, "7e9", "7B", "494M", "1.5T" -> a positive number, else a one-line PlanError."""
    text = str(value).strip()
    scale = _SUFFIX.get(text[-1:].upper(), 1.0) if text else 1.0
    try:
        number = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise invalid(name, value, "expected a number such as 7e9, 7B or 494M") from None
    if not math.isfinite(number) or number <= 0:
        raise invalid(name, value, "expected a number > 0")
    return number


# ---------------------------------------------------------------------------- config.json

def read_config(path: Union[str, Path]) -> dict:
    """The dict of a config.json, or of the config.json in directory ``path``."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not path.exists():
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None
        raise invalid("model", str(path), "no such file or folder here; nothing is downloaded"
                      + (f": fetch its config.json first (huggingface-cli download {path} "
                         f"config.json) and give that file" if hub else
                         ": give a local config.json or its folder"))
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise invalid("model", str(path), f"cannot read {file}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise invalid("model", str(path), f"{file} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise invalid("model", str(path), f"{file} holds no JSON object")
    return config


def count_config(path: Union[str, Path]) -> ModelCount:
    """Parameters of the model a config.json describes: transformers on the meta device when
    it is installed and knows the architecture, else the decoder formula."""
    config = read_config(path)
    counted, why = _meta_count(config)
    if counted is not None:
        return counted
    return formula_count(config, why=why, where=str(path))


def _meta_count(config: dict) -> tuple[Optional[ModelCount], str]:
    """(count, "") built by transformers on the meta device, or (None, why it was not)."""
    try:
        import torch
        import transformers
        from transformers import AutoConfig
    except ImportError:
        return None, "transformers is not installed"
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        return None, f"transformers {transformers.__version__} does not know model_type {model_type!r}"
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()   # a tiny test config draws token-id warnings
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model, cls = _build(transformers, hf_config)
    except Exception as exc:  # noqa: BLE001 - any failure to build falls back to the formula
        return None, f"transformers could not build it ({type(exc).__name__}: {str(exc)[:120]})"
    finally:
        transformers.logging.set_verbosity(verbosity)
    numels = tuple(p.numel() for p in model.parameters())  # tied weights are counted once
    shape, note = shape_of(config)
    return ModelCount(sum(numels), _layers(model), f"counted on the meta device: {cls} "
                                                   f"(transformers {transformers.__version__})",
                      numels, shape, note), ""


def _build(transformers, hf_config):
    """The config's first architecture when transformers has it, else a causal LM, else the
    bare model. Only classes of transformers itself: no remote code."""
    names = [n for n in (getattr(hf_config, "architectures", None) or []) if hasattr(transformers, n)]
    if names:
        return getattr(transformers, names[0])(hf_config), names[0]
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except ValueError:
        model = transformers.AutoModel.from_config(hf_config)
    return model, type(model).__name__


def _layers(model) -> tuple:
    """Every Linear (weight out x in) and transformers Conv1D (weight in x out) module."""
    import torch
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out_f, in_f = module.weight.shape
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            in_f, out_f = module.weight.shape
        else:
            continue
        layers.append(LinearLayer(name, int(in_f), int(out_f), output=module is output))
    return tuple(layers)


def _field(config: dict, names: Sequence[str], where: str, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is not None:
        return default
    alternatives = " or ".join(repr(n) for n in names)
    raise PlanError(f"Invalid model (--model): {where} has no {alternatives}, needed to count "
                    f"a decoder's parameters; give --params instead")


def formula_count(config: dict, *, why: str = "", where: str = "config.json") -> ModelCount:
    """The decoder formula: GPT-2's layout for model_type "gpt2", else a Llama-style decoder
    (gated MLP, two norms per layer, rotary positions). docs/planning.md spells out both."""
    model_type = config.get("model_type") or "unknown"
    vocab = int(_field(config, ("vocab_size",), where))
    hidden = int(_field(config, ("hidden_size", "n_embd", "d_model"), where))
    layers = int(_field(config, ("num_hidden_layers", "n_layer", "num_layers"), where))
    heads = int(_field(config, ("num_attention_heads", "n_head"), where))
    if model_type == "gpt2":
        numels, linears = _gpt2(config, vocab, hidden, layers, where)
    else:
        numels, linears = _llama(config, vocab, hidden, layers, heads, where)
    # NOTE: a tied lm_head is still a Linear module that peft can target by name.
    linears.append(LinearLayer("lm_head", hidden, vocab, output=True))
    family = "GPT-2" if model_type == "gpt2" else "Llama-style"
    because = f"; {why}" if why else ""
    shape, note = shape_of(config)
    return ModelCount(sum(numels), tuple(linears), f"formula for a {family} decoder "
                                                   f"(model_type {model_type!r}{because})",
                      tuple(numels), shape, note)


def _gpt2(config: dict, vocab: int, hidden: int, layers: int, where: str):
    """wte + wpe, per block: ln_1, c_attn (H -> 3H), c_proj, ln_2, c_fc (H -> I), c_proj,
    every one with a bias; ln_f; lm_head tied unless tie_word_embeddings is false."""
    positions = int(_field(config, ("n_positions", "max_position_embeddings"), where))
    inner = int(config.get("n_inner") or 4 * hidden)
    tied = config.get("tie_word_embeddings", True) is not False
    shapes = [("attn.c_attn", hidden, 3 * hidden), ("attn.c_proj", hidden, hidden),
              ("mlp.c_fc", hidden, inner), ("mlp.c_proj", inner, hidden)]
    block = [hidden, hidden] * 2 + [n for _, i, o in shapes for n in (i * o, o)]
    numels = [vocab * hidden, positions * hidden, *block * layers, hidden, hidden]
    numels += [] if tied else [vocab * hidden]
    linears = [LinearLayer(f"transformer.h.{b}.{n}", i, o) for b in range(layers) for n, i, o in shapes]
    return numels, linears


def _llama(config: dict, vocab: int, hidden: int, layers: int, heads: int, where: str):
    """embed, per layer: q (H -> heads x hd), k and v (H -> kv x hd), o, gate and up
    (H -> I), down, two RMSNorms; a final norm; lm_head unless tie_word_embeddings.
    Biases: q, k, v for qwen2; attention_bias and mlp_bias where the config sets them."""
    inner = int(_field(config, ("intermediate_size",), where))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = attention_bias or config.get("model_type") == "qwen2"
    mlp_bias = bool(config.get("mlp_bias", False))
    tied = bool(config.get("tie_word_embeddings", False))
    shapes = [("self_attn.q_proj", hidden, heads * head_dim, qkv_bias),
              ("self_attn.k_proj", hidden, kv_heads * head_dim, qkv_bias),
              ("self_attn.v_proj", hidden, kv_heads * head_dim, qkv_bias),
              ("self_attn.o_proj", heads * head_dim, hidden, attention_bias),
              ("mlp.gate_proj", hidden, inner, mlp_bias), ("mlp.up_proj", hidden, inner, mlp_bias),
              ("mlp.down_proj", inner, hidden, mlp_bias)]
    layer = [n for _, i, o, bias in shapes for n in ((i * o, o) if bias else (i * o,))]
    numels = [vocab * hidden, *(layer + [hidden, hidden]) * layers, hidden]
    numels += [] if tied else [vocab * hidden]
    linears = [LinearLayer(f"model.layers.{n}.{name}", i, o)
               for n in range(layers) for name, i, o, _ in shapes]
    return numels, linears


# ---------------------------------------------------------------------------- trainable

def lora_params(layers: Sequence[LinearLayer], rank: int, targets: Sequence[str]) -> int:
    """LoRA's trainable parameters as peft counts them: r x (in + out) for each targeted
    layer (A is r x in, B is out x r). A target matches a module named exactly so or ending
    in "." + target; "all-linear" is every linear layer but the output layer."""
    return sum(lora_numels(layers, rank, targets))


def lora_numels(layers: Sequence[LinearLayer], rank: int, targets: Sequence[str]) -> list:
    """The elements of each LoRA matrix peft adds (A: r x in, B: out x r per target layer)."""
    if list(targets) == ["all-linear"]:
        chosen = [layer for layer in layers if not layer.output]
    else:
        chosen = [layer for layer in layers
                  if any(layer.name == t or layer.name.endswith("." + t) for t in targets)]
    if not chosen:
        suffixes = sorted({layer.name.rsplit(".", 1)[-1] for layer in layers})
        raise invalid("lora_targets", ",".join(targets),
                      f"matches no linear layer of the model; its layers end in {', '.join(suffixes)}")
    return [n for layer in chosen for n in (rank * layer.in_features, rank * layer.out_features)]


def trainable_count(total: float, trainable: Union[None, str, float]) -> tuple[int, str]:
    """A fraction (<= 1) or a count (> 1, at most ``total``) -> (count, how it was given)."""
    if trainable is None:
        return int(total), "all parameters"
    number = parse_count("trainable", trainable)
    if number <= 1:
        return max(1, int(round(total * number))), f"--trainable {number:g} of the parameters"
    if number > total:
        raise invalid("trainable", trainable, f"more than the model's {total:,.0f} parameters")
    return int(number), "--trainable count"


def model_facts(*, params=None, model=None, trainable=None, lora_rank=None, lora_targets=None,
                small_param_threshold: int = SMALL_PARAM_THRESHOLD) -> ModelFacts:
    """The model's counts from the plan's model arguments, checked."""
    if (params is None) == (model is None):
        raise PlanError("Invalid params (--params) / model (--model): give exactly one "
                        "(a count such as 7e9, or the path of a config.json)")
    counted = count_config(model) if model is not None else \
        ModelCount(int(parse_count("params", params)), (), "given: --params")
    if lora_rank is None and lora_targets is None:
        count, how = trainable_count(counted.total, trainable)
        return ModelFacts(counted.total, count, counted.source, how, counted.shape,
                          counted.shape_note, _grads(counted, count, small_param_threshold))
    return _lora_facts(counted, trainable, lora_rank, lora_targets, small_param_threshold)


PARTLY_TRAINED = "which parameters train is not known: the largest and every small one are assumed to"


def _grads(counted: ModelCount, trainable: int, threshold: int) -> Optional[GradLayout]:
    """The trainable parameters' layout, or None when the count gave no sizes."""
    if not counted.numels:
        return None
    every = layout(counted.numels, threshold)
    if trainable >= counted.total:
        return every
    small = min(every.small, trainable)
    return GradLayout(threshold, trainable - small, min(every.largest, trainable - small), small,
                      every.small_params, assumed=PARTLY_TRAINED)


def _lora_facts(counted: ModelCount, trainable, lora_rank, lora_targets,
                threshold: int) -> ModelFacts:
    if trainable is not None:
        raise invalid("trainable", trainable, "give either --trainable or --lora-rank, not both")
    if lora_rank is None or not lora_targets:
        raise PlanError("Invalid lora_rank (--lora-rank) / lora_targets (--lora-targets): a LoRA "
                        "plan needs both, e.g. --lora-rank 16 --lora-targets q_proj,v_proj")
    rank = parse_count("lora_rank", lora_rank)
    if rank != int(rank):
        raise invalid("lora_rank", lora_rank, "expected a whole number >= 1")
    if not counted.layers:
        raise invalid("lora_rank", lora_rank, "LoRA needs --model (a config.json) for the "
                      "target layers' shapes; or give --trainable COUNT")
    targets = [t.strip() for t in (lora_targets.split(",") if isinstance(lora_targets, str)
                                   else lora_targets) if t.strip()]
    numels = lora_numels(counted.layers, int(rank), targets)
    count = sum(numels)
    return ModelFacts(counted.total + count, count, counted.source,
                      f"LoRA r={int(rank)} on {','.join(targets)} (the base model frozen)",
                      counted.shape, counted.shape_note, layout(numels, threshold))
