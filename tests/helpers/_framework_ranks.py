"""What each rank of tests/distributed/test_integrations_ranks.py runs: accelerate and the HF Trainer on
several gloo ranks, in the environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, ...), each framework setting up torch.distributed itself.

``launch(scenario, world, out_dir)`` starts the ranks on a free 127.0.0.1 port; each saves
``SCENARIOS[scenario](rank, out_dir)`` (a dict) as ``out_dir/<rank>.pt``.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _distributed_workers import free_port

TIMEOUT_S = 300.0
FIRES = 0.05  # max_grad_norm below both models' gradient norms: clipping fires every step


def launch(scenario: str, world: int, out_dir: str, timeout_s: float = TIMEOUT_S) -> list:
    context = mp.start_processes(_main, args=(world, free_port(), scenario, str(out_dir)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"scenario {scenario!r} on {world} ranks ran past {timeout_s} s")
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def _main(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    try:
        result = SCENARIOS[scenario](rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (see _distributed_workers._main: torch's teardown once in a while aborts)


def _snapshot(model: torch.nn.Module, opt) -> dict:
    return dict(params=[p.detach().clone() for p in model.parameters()],
                state=[{k: opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
                       for p in model.parameters()])


# --------------------------------------------------------------------------- accelerate


def _accelerate_run(mode: str) -> dict:
    import accelerate
    from accelerate.state import AcceleratorState, GradientState
    from adambridge import AdamBridge
    from adambridge.integrations import accelerate as integration
    AcceleratorState._reset_state(True)  # process-wide singletons, one run after another
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = AdamBridge(model.parameters(), lr=1e-2, backend="torch", small_param_threshold=512)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(28, 16, generator=g),
                                          torch.randn(28, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    wrapped = type(model).__name__
    if mode == "async":
        integration.attach_hooks(accelerator, model, opt)
    norms = []
    for _ in range(2):
        for x, y in loader:  # 7 batches a rank: windows of 2, the last of one
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), FIRES)))
                opt.step()
                opt.zero_grad()
    inner = opt.optimizer
    hooked = inner.pipeline is not None
    if hooked:
        integration.detach_hooks(opt)
    return dict(_snapshot(model, inner), norms=norms, wrapped=wrapped, hooked=hooked,
                kind=accelerator.distributed_type.value)


def accelerate_ranks(rank: int, out_dir: str) -> dict:
    return {mode: _accelerate_run(mode) for mode in ("sync", "async")}


# --------------------------------------------------------------------------- transformers


def _trainer_run(mode: str, out_dir: str) -> dict:
    import transformers
    from test_integrations_transformers import Rows, tiny_gpt2
    from adambridge.integrations.transformers import AdamBridgeCallback, optimizer_cls_and_kwargs
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, mode), per_device_train_batch_size=1,
        gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2, max_grad_norm=FIRES,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
        disable_tqdm=True, seed=0)
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", small_param_threshold=1024)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=mode == "async")])
    trainer.train()
    opt = trainer.optimizer.optimizer
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return dict(_snapshot(trainer.model, opt), norms=norms, world=args.world_size,
                wrapped=type(trainer.model_wrapped).__name__)


def trainer_ranks(rank: int, out_dir: str) -> dict:
    return {mode: _trainer_run(mode, out_dir) for mode in ("sync", "async")}


def _shard_state_run(out_dir: str, streamed: bool, resume: bool = False) -> dict:
    """shard_state=True under the Trainer: 4 steps, a checkpoint every 2, or a resume from
    step 2; the gathered state_dict() (a collective) and the parameters at the end."""
    import transformers
    from test_integrations_transformers import Rows, tiny_gpt2
    from adambridge.integrations.transformers import (AdamBridgeCallback,
                                                      optimizer_cls_and_kwargs, stream_saves)
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, max_steps=4, save_steps=2,
        learning_rate=1e-2, report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
        seed=0)
    kwargs = optimizer_cls_and_kwargs(args, backend="torch", precision="bf16", shard_state=True)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(),
                                   optimizer_cls_and_kwargs=kwargs,
                                   callbacks=[AdamBridgeCallback(async_mode=False)])
    if streamed:
        stream_saves(trainer)
    try:
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2")
                      if resume else None)
    except ValueError as refused:
        return dict(refused=str(refused))
    return dict(params=[p.detach().clone() for p in trainer.model.parameters()],
                state=trainer.optimizer.optimizer.state_dict()["state"])


def trainer_shard_state_ranks(rank: int, out_dir: str) -> dict:
    folder = os.path.join(out_dir, "run")
    return dict(whole=_shard_state_run(folder, streamed=True),
                resumed=_shard_state_run(folder, streamed=True, resume=True),
                unstreamed=_shard_state_run(os.path.join(out_dir, "plain"), streamed=False))


SCENARIOS = {"accelerate": accelerate_ranks, "trainer": trainer_ranks,
             "trainer_shard_state": trainer_shard_state_ranks}
