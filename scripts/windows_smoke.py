"""What a Windows user does first, checked: run by a Windows CPython (scripts/windows_check.sh).

import, ``python -m adambridge info``, sync and async steps at every precision on every ISA
the CPU has (native against the torch twin bit for bit, fp32 against torch.optim.AdamW; the
async runs hook every parameter, or the weights only, and check that each hook fired at each
step, since this model's tensors are all under the default small_param_threshold), a
checkpoint round trip, the kernel cache (published, locked, verified and loaded from a second
process), and the NVMe tier (offload_dir) with its directory lock. Prints one line per check
and ``windows_smoke: N passed, M failed``; exits 1 on any failure.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

import adambridge
from adambridge.nvme import layout
from adambridge.host import platform_facts
from adambridge._native import build, loader

PRECISIONS = ("fp32", "bf16", "fp8")
SIZES = (1, 17, 300, 4097)
STEPS = 3
# small_param_threshold of the async runs: each of this model's tensors is under the default
# (65536), which would leave every one without a hook and the run never asynchronous.
HOOK_EVERY_PARAMETER = 0
HOOK_THE_WEIGHTS = 1000  # the two weight matrices (19200, 5100) hooked; biases at the step
results = {"passed": 0, "failed": 0}


def check(name: str, ok: bool, detail: str = "") -> None:
    results["passed" if ok else "failed"] += 1
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}",
          flush=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 17))


def count_hook_calls(pipeline) -> list:
    """The parameters whose gradients the pipeline's hooks hand it, in order: its on_grad,
    which every hook calls, wrapped on this one instance."""
    received = []
    on_grad = pipeline.on_grad

    def counted(p, *args, **kwargs):
        received.append(p)
        return on_grad(p, *args, **kwargs)
    pipeline.on_grad = counted
    return received


def train(net, opt, steps: int = STEPS, hooks: bool = False) -> tuple:
    """``steps`` steps; with hooks, (the parameters hooked, those each hook call handed over)."""
    hooked, received = [], []
    if hooks:
        opt.attach_hooks(net)
        hooked, received = list(opt.pipeline.hooked), count_hook_calls(opt.pipeline)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=gen)
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if hooks:
        opt.detach_hooks()
    return hooked, received


def run(precision: str, backend: str, hooks: bool = False, **kwargs):
    net = model()
    opt = adambridge.AdamBridge(net.parameters(), lr=1e-2, weight_decay=0.1, precision=precision,
                                backend=backend, **kwargs)
    train(net, opt, hooks=hooks)
    return net, opt


def run_hooked(precision: str, threshold: int) -> tuple:
    """An async run: (net, opt), and whether exactly the parameters of at least
    ``threshold`` elements were hooked and each hook fired once per step."""
    net = model()
    opt = adambridge.AdamBridge(net.parameters(), lr=1e-2, weight_decay=0.1, precision=precision,
                                backend="native", small_param_threshold=threshold)
    hooked, received = train(net, opt, hooks=True)
    want = [p for p in net.parameters() if p.numel() >= threshold]
    fired = {id(p): sum(q is p for q in received) for p in want}
    ok = (bool(want) and [id(p) for p in hooked] == [id(p) for p in want]
          and len(received) == STEPS * len(want) and set(fired.values()) == {STEPS})
    return (net, opt), ok, f"{len(hooked)} hooked of {len(want)}, {len(received)} hook calls"


def same_run(a, b) -> bool:
    (net_a, opt_a), (net_b, opt_b) = a, b
    if not all(same_bits(p, q) for p, q in zip(net_a.parameters(), net_b.parameters())):
        return False
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        same_bits(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def check_platform_and_info() -> None:
    facts = platform_facts.facts()
    check("platform facts say windows", facts == platform_facts.facts_of("windows"), str(facts))
    done = subprocess.run([sys.executable, "-m", "adambridge", "info"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    print(done.stdout, end="")
    check("python -m adambridge info exits 0 with result PASS",
          done.returncode == 0 and "result:         PASS" in done.stdout, done.stderr[-2000:])


def check_cache() -> None:
    native = loader.load()
    root = build.cache_root()
    check("the library comes from the cache, verified", not native.built.private and
          native.path.parent.parent == root and (native.path.parent / build.MANIFEST).is_file(),
          str(native.path))
    code = ("from adambridge._native import loader; n = loader.load(); "
            "print(n.path, n.built.fresh)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    check("a second process loads the published library without building",
          done.returncode == 0 and done.stdout.split() == [str(native.path), "False"],
          done.stdout + done.stderr[-2000:])


def check_steps() -> None:
    native = loader.load()
    isas = native.isas(native.lib.ab_isa_supported)
    check("the pool runs threads", loader.num_threads() == (os.cpu_count() or 1),
          f"{loader.num_threads()} threads, {os.cpu_count()} CPUs")
    for isa in isas:
        native.check(native.lib.ab_set_isa(loader.ISA_NAMES.index(isa)), f"ab_set_isa({isa})")
        for precision in PRECISIONS:
            want = run(precision, "torch")
            check(f"{isa} sync {precision}: native equals torch bit for bit",
                  same_run(run(precision, "native"), want))
            for what, threshold in (("every parameter", HOOK_EVERY_PARAMETER),
                                    ("the weights", HOOK_THE_WEIGHTS)):
                hooked, fired, detail = run_hooked(precision, threshold)
                check(f"{isa} async {precision}, {what} hooked: each hook fired every step",
                      fired, detail)
                check(f"{isa} async {precision}, {what} hooked: equals sync bit for bit",
                      same_run(hooked, want))
    native.lib.ab_set_isa(native.lib.ab_isa_detected())
    check("fp32 native equals torch.optim.AdamW within rtol 1e-6, atol 1e-7", matches_adamw())


def matches_adamw(steps: int = 5) -> bool:
    """Native fp32 against torch.optim.AdamW on the same gradients, params and moments."""
    gen = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = adambridge.AdamBridge(ours, lr=1e-2, weight_decay=0.1, backend="native")
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    return all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) and
               torch.allclose(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-6, atol=1e-7)
               and torch.allclose(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"],
                                  rtol=1e-6, atol=1e-7)
               for p, q in zip(ours, theirs))


def check_checkpoint() -> None:
    for precision in PRECISIONS:
        whole = run(precision, "native")
        net = model()
        opt = adambridge.AdamBridge(net.parameters(), lr=1e-2, weight_decay=0.1,
                                    precision=precision, backend="native")
        train(net, opt, steps=2)
        saved = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=True)
        net2 = model(seed=1)
        net2.load_state_dict(loaded["model"])
        opt2 = adambridge.AdamBridge(net2.parameters(), lr=1e-2, weight_decay=0.1,
                                     precision=precision, backend="native")
        opt2.load_state_dict(loaded["opt"])
        gen = torch.Generator().manual_seed(7)
        for _ in range(2):  # the gradients the uninterrupted run's first two steps used
            torch.randn(8, 64, generator=gen)
        x = torch.randn(8, 64, generator=gen)
        net2(x).square().mean().backward()
        opt2.step()
        check(f"checkpoint round trip {precision}: resume equals the uninterrupted run",
              same_run((net2, opt2), whole))


def check_tier() -> None:
    with tempfile.TemporaryDirectory() as directory:
        for precision in ("bf16", "fp8"):
            path = Path(directory) / precision
            path.mkdir()
            tier = run(precision, "native", offload_dir=str(path), host_budget=0)
            check(f"offload_dir {precision}: equals the run in RAM bit for bit",
                  same_run(tier, run(precision, "native")))
            try:
                adambridge.AdamBridge(model().parameters(), offload_dir=str(path))
                check(f"offload_dir {precision}: a second optimizer is locked out", False)
            except ValueError as exc:
                check(f"offload_dir {precision}: a second optimizer is locked out",
                      "in use by another optimizer" in str(exc), str(exc))
            committed = layout.read_committed(path)
            saved = tier[1].state_dict()["state"]
            check(f"offload_dir {precision}: read_committed finds the last step",
                  bool(committed) and all(int(s["step"]) == 3 for s in committed.values())
                  and all(same_bits(s["master"], saved[i]["master"]) for i, s in committed.items()))
            tier[1].nvme_tier.close()


def main() -> int:
    print(f"windows_smoke: Python {sys.version.split()[0]} on {sys.platform}, torch "
          f"{torch.__version__}, adambridge from {Path(adambridge.__file__).parent}", flush=True)
    quick = sys.argv[1:] == ["--quick"]
    steps = (check_platform_and_info, check_cache, check_steps) if quick else (
        check_platform_and_info, check_cache, check_steps, check_checkpoint, check_tier)
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - one failed check must not hide the others
            check(step.__name__, False, traceback.format_exc())
    print(f"windows_smoke: {results['passed']} passed, {results['failed']} failed", flush=True)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
