"""The peers measured beside AdamBridge: bitsandbytes, DeepSpeed and torchao, built by name.

The demo (`python -m adambridge demo --peers`) and benchmarks/finetune_llm.py build each peer
from the same list, so both compare the same optimizers. A peer's package is imported only
when the peer is prepared or built; `pip install "adambridge[peers]"` installs all three.
The bytes an optimizer holds are counted from the tensors it really holds (`held_bytes`),
never taken from a peer's documentation.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

INSTALL = 'pip install "adambridge[peers]"'


class HostMasterOptimizer:
    """A CPU optimizer stepping host copies of the model's parameters (ZeRO-Offload's split).

    Each step copies the gradients into the masters' dtype on the host, steps the inner
    optimizer there, and copies the masters back into the parameters (rounding to nearest
    into the parameters' dtype). `master_dtype` float32 is ZeRO-Offload's fp32 host master;
    bfloat16 is its bf16 master, which DeepSpeed needs for bf16 optimizer states.
    """

    def __init__(self, params, make: Callable[[list], Any], *,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().to("cpu", master_dtype, copy=True).requires_grad_()
                        for p in self.params]
        self.inner = make(self.masters)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to("cpu", m.dtype)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensor in self.params + self.masters:
            tensor.grad = None


# ---------------------------------------------------------------------------- the peers

def _bnb(name: str) -> Callable:
    def build(params: list, hyper: dict, device: torch.device) -> Any:
        import bitsandbytes as bnb
        return getattr(bnb.optim, name)(params, **hyper)
    return build


def _deepspeed(master_dtype: torch.dtype) -> Callable:
    # NOTE: DeepSpeedCPUAdam stores its moments in the parameter's dtype when
    # fp32_optimizer_states=False, so bf16 states come only with a bf16 master; DeepSpeed's
    # own config says so ("bf16_optimizer_states requires bf16_master_weights_and_grads").
    def build(params: list, hyper: dict, device: torch.device) -> Any:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        fp32_states = master_dtype == torch.float32
        return HostMasterOptimizer(
            params, lambda masters: DeepSpeedCPUAdam(masters, adamw_mode=True,
                                                     fp32_optimizer_states=fp32_states, **hyper),
            master_dtype=master_dtype)
    return build


def _torchao(name: str, **options: Any) -> Callable:
    def build(params: list, hyper: dict, device: torch.device) -> Any:
        import torchao.optim
        return getattr(torchao.optim, name)(params, **hyper, **options)
    return build


def _torchao_offload(params: list, hyper: dict, device: torch.device) -> Any:
    from torchao.optim import CPUOffloadOptimizer
    return CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **hyper)


def _import(package: str) -> Callable[[], None]:
    def prepare() -> None:
        importlib.import_module(package)
    return prepare


def _deepspeed_prepare() -> None:
    # NOTE: DeepSpeed builds its CPU Adam with g++ on first use (about a minute); doing it
    # before the run keeps the build out of the run's memory and time.
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer optimizer: how it is built, the weights' dtype it runs with, its package."""
    name: str
    label: str
    package: str                 # import name and pip name
    weights: torch.dtype         # how the model stores its weights under this peer
    build: Callable[[list, dict, torch.device], Any]
    prepare: Optional[Callable[[], None]] = None  # before the run: import, build native code

    def prepared(self) -> None:
        (self.prepare or _import(self.package))()


PEERS = {p.name: p for p in [
    Peer("bnb-adamw8bit", "bitsandbytes AdamW8bit", "bitsandbytes", torch.float32, _bnb("AdamW8bit")),
    Peer("bnb-paged-adamw8bit", "bitsandbytes PagedAdamW8bit", "bitsandbytes", torch.float32,
         _bnb("PagedAdamW8bit")),
    Peer("deepspeed-cpu-adam", "DeepSpeed CPU Adam, fp32 master + fp32 states", "deepspeed",
         torch.bfloat16, _deepspeed(torch.float32), _deepspeed_prepare),
    Peer("deepspeed-cpu-adam-bf16", "DeepSpeed CPU Adam, bf16 master + bf16 states", "deepspeed",
         torch.bfloat16, _deepspeed(torch.bfloat16), _deepspeed_prepare),
    Peer("torchao-adamw8bit", "torchao AdamW8bit", "torchao", torch.float32, _torchao("AdamW8bit")),
    Peer("torchao-adamw4bit", "torchao AdamW4bit", "torchao", torch.float32, _torchao("AdamW4bit")),
    Peer("torchao-adamwfp8", "torchao AdamWFp8", "torchao", torch.float32, _torchao("AdamWFp8")),
    Peer("torchao-adamw8bit-bf16", "torchao AdamW8bit, bf16 weights + stochastic rounding", "torchao",
         torch.bfloat16, _torchao("AdamW8bit", bf16_stochastic_round=True)),
    Peer("torchao-offload", "torchao CPUOffloadOptimizer", "torchao", torch.float32, _torchao_offload),
    Peer("torchao-offload-bf16", "torchao CPUOffloadOptimizer, bf16 weights", "torchao",
         torch.bfloat16, _torchao_offload),
]}
PACKAGES = tuple(dict.fromkeys(p.package for p in PEERS.values()))


# ---------------------------------------------------------------------------- installed or not

def installed(package: str) -> bool:
    """Whether `package` can be imported here (found, not imported: that stays cheap)."""
    return importlib.util.find_spec(package) is not None


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def skipped_line() -> str:
    """One line for a run without --peers: which peers it left out and how to add them."""
    present = [f"{p} {version(p)}" for p in PACKAGES if installed(p)]
    missing = [p for p in PACKAGES if not installed(p)]
    parts = [f"{', '.join(present)} installed: add --peers to run them"] if present else []
    if missing:
        parts.append(f"{', '.join(missing)} not installed: {INSTALL}, then add --peers")
    return f"peers skipped ({'; '.join(parts)})"


def pick(names: str) -> list:
    """The peers named (comma-separated), or every peer for "all"; ValueError names an unknown one."""
    if names == "all":
        return list(PEERS.values())
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in PEERS]
    if unknown or not chosen:
        named = ", ".join(unknown) if unknown else repr(names)
        raise ValueError(f"unknown peer(s): {named}; choose all or from {', '.join(PEERS)}")
    return [PEERS[n] for n in chosen]


# ---------------------------------------------------------------------------- bytes held

def held_tensors(opt: Any) -> list:
    """Every tensor an optimizer holds besides the model's parameters: its state, and the host
    copies a host-master design keeps."""
    if hasattr(opt, "optim_dict"):
        # NOTE: torchao's CPUOffloadOptimizer never calls Optimizer.__init__, so it has no
        # `state`: one inner optimizer per offloaded parameter (its host copy, param_d2h_map)
        # and d_opt for the small ones left on the device.
        inner = list(opt.optim_dict.values()) + ([opt.d_opt] if opt.d_opt is not None else [])
        return [t for o in inner for t in held_tensors(o)] + list(opt.param_d2h_map.values())
    tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return tensors + list(getattr(opt, "masters", []))


def _leaves(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors behind a tensor subclass (torchao's quantized states hold codes and
    scales behind a float32 face), or the tensor itself."""
    if not hasattr(tensor, "__tensor_flatten__"):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from _leaves(getattr(tensor, name))


def held_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (bitsandbytes shares one
    quantization map among all its states; a view costs no more than its base)."""
    seen, total = set(), 0
    for tensor in tensors:
        for leaf in _leaves(tensor):
            storage = leaf.untyped_storage()
            key = (leaf.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def state_bytes_per_param(opt: Any, numel: int) -> float:
    """Bytes the optimizer holds per model parameter, counted from its tensors."""
    return held_bytes(held_tensors(opt)) / numel
