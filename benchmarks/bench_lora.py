"""LoRA (peft) training-step time: torch AdamW vs AdamBridge step() vs attach_hooks.

A GPT-2 built from a config (no download) with LoRA adapters on every attention and MLP
projection; only the adapters train. Every variant holds its own copy of the model; the timed
steps are interleaved (A, B, C, D, A, B, ...) so a noisy machine slows all of them alike,
and each is reported as the median of its steps, as a ratio to torch AdamW. Afterwards the
AdamBridge variants' adapters are checked to be equal bit for bit (same data, same steps).

  python benchmarks/bench_lora.py                 # CPU: width 256, 4 blocks, r=16
  python benchmarks/bench_lora.py --clip          # + clip_grad_norm_(1.0) each step
  python benchmarks/bench_lora.py --width 1024 --layers 8 --device cuda

The adapters are all under the default small_param_threshold (65536 elements), so
"async default" hooks none of them; "async threshold 0" hooks every adapter.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import peft  # noqa: E402
import transformers  # noqa: E402

from adambridge import AdamBridge  # noqa: E402
from adambridge.lab import trust  # noqa: E402


def lora_model(args) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=1024, n_positions=args.seq, n_embd=args.width,
                                     n_layer=args.layers, n_head=max(1, args.width // 64),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                           target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                           init_lora_weights=False)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).to(args.device).train()


def variant(name: str, args):
    model = lora_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "torch AdamW":
        return model, torch.optim.AdamW(params, lr=1e-4)
    threshold = 0 if name == "async threshold 0" else 65536
    opt = AdamBridge(params, lr=1e-4, small_param_threshold=threshold)
    if name.startswith("async"):
        opt.attach_hooks(model)
    return model, opt


def step(model, opt, batch, clip: bool) -> None:
    model(input_ids=batch, labels=batch).loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip", action="store_true",
                        help="clip_grad_norm_(1.0) before each step (then the check allows "
                             "fp32 rounding, compounding per step)")
    args = parser.parse_args()
    names = ["torch AdamW", "sync step()", "async default", "async threshold 0"]
    runs = {name: variant(name, args) for name in names}
    model = runs[names[0]][0]
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1024, (args.batch, args.seq), generator=g).to(args.device)
               for _ in range(args.warmup + args.steps)]
    times = {name: [] for name in names}
    monitor = trust.LoadMonitor(torch.get_num_threads())
    for i, batch in enumerate(batches):
        for name in names:
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                monitor.sample()
            start = time.perf_counter()
            step(*runs[name], batch, args.clip)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    adapters = {name: [p.detach() for p in runs[name][0].parameters() if p.requires_grad]
                for name in names[1:]}
    # Without clipping hooked training equals step() bit for bit; with it, to fp32 rounding
    # (the norm is summed in another order), which the later steps' gradients compound.
    steps = len(batches)
    tolerance = (dict(rtol=steps * 1e-6, atol=steps * 1e-7) if args.clip
                 else dict(rtol=0, atol=0))
    for name in names[2:]:
        for a, b in zip(adapters[names[1]], adapters[name]):
            torch.testing.assert_close(b, a, **tolerance, msg=name)
    print(f"LoRA GPT-2 width {args.width}, {args.layers} blocks, r={args.rank}, batch "
          f"{args.batch}x{args.seq}, {args.device}: {len(sizes)} adapters, {sum(sizes)} "
          f"trainable elements (largest {max(sizes)}); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(trust.judge(times, monitor).line)
    base = statistics.median(times[names[0]])
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name:<18} {median * 1e3:8.1f} ms/step  {median / base:5.2f}x AdamW")
    for name in names[2:]:
        runs[name][1].detach_hooks()


if __name__ == "__main__":
    main()
