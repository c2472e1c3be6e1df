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


def _count_gathered_saves() -> list:
    """Records the gathered saves in this rank's process (whether this rank wrote, one
    element a save), so a test sees that a framework's save went through it."""
    from adambridge.distributed import zero_gathered
    calls, own = [], zero_gathered.save

    def save(opt, obj, f):
        calls.append(f is not None)
        return own(opt, obj, f)

    zero_gathered.save = save
    return calls


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
    calls = _count_gathered_saves()
    whole = _shard_state_run(folder, streamed=True)
    return dict(whole=whole, gathered_saves=list(calls),
                resumed=_shard_state_run(folder, streamed=True, resume=True),
                unstreamed=_shard_state_run(os.path.join(out_dir, "plain"), streamed=False))


# --------------------------------------------------------------------------- shard_state saves


def _accelerate_shard_state_run(folder: str, resume: bool) -> dict:
    """shard_state under accelerate: 4 steps with save_state after 2, or load_state and the
    last 2; each rank its own seeded data."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState
    from adambridge import AdamBridge
    from adambridge.integrations.accelerate import stream_saves
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="bf16", shard_state=True)
    model, opt = accelerator.prepare(model, opt)
    stream_saves(accelerator)
    if resume:
        accelerator.load_state(folder)
    for step in range(2, 4) if resume else range(4):
        g = torch.Generator().manual_seed(10 * step + accelerator.process_index)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 1:
            accelerator.save_state(folder)
    return dict(params=[p.detach().clone() for p in model.parameters()],
                state=opt.optimizer.state_dict()["state"])


def accelerate_shard_state_ranks(rank: int, out_dir: str) -> dict:
    folder = os.path.join(out_dir, "state")
    calls = _count_gathered_saves()
    whole = _accelerate_shard_state_run(folder, resume=False)
    return dict(whole=whole, gathered_saves=list(calls),
                resumed=_accelerate_shard_state_run(folder, resume=True))


def _lightning_shard_state_run(out_dir: str, resume: bool, io=None) -> dict:
    """shard_state under Lightning's DDP on the ranks this process is one of: 4 steps with a
    checkpoint every 2, or a fit from the step-2 checkpoint."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from adambridge.integrations.lightning import AdamBridgeCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(),
                                           torch.nn.Linear(300, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            from adambridge import AdamBridge
            return AdamBridge(self.parameters(), lr=1e-2, precision="bf16", shard_state=True)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            # 2 batches a rank an epoch: the step-2 checkpoint ends an epoch, the one point
            # Lightning itself resumes exactly with a plain DataLoader
            data = torch.utils.data.TensorDataset(torch.randn(8, 16, generator=g),
                                                  torch.randn(8, 4, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=2)

    module = Module()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        plugins=[io] if io is not None else None,
        callbacks=[AdamBridgeCallback(async_mode=False),
                   ModelCheckpoint(dirpath=out_dir, every_n_train_steps=2, save_top_k=-1)])
    try:
        trainer.fit(module, ckpt_path=os.path.join(out_dir, "epoch=0-step=2.ckpt")
                    if resume else None)
    except ValueError as refused:
        return dict(refused=str(refused))
    opt = trainer.optimizers[0]
    return dict(params=[p.detach().clone() for p in module.parameters()],
                state=opt.state_dict()["state"])


def lightning_shard_state_ranks(rank: int, out_dir: str) -> dict:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class OwnIO(TorchCheckpointIO):
        """A CheckpointIO of the user's own (the callback replaces only the default)."""

    folder = os.path.join(out_dir, "run")
    calls = _count_gathered_saves()
    whole = _lightning_shard_state_run(folder, resume=False)
    return dict(whole=whole, gathered_saves=list(calls),
                resumed=_lightning_shard_state_run(folder, resume=True),
                own_io=_lightning_shard_state_run(os.path.join(out_dir, "own"), resume=False,
                                                  io=OwnIO()))


SCENARIOS = {"accelerate": accelerate_ranks, "trainer": trainer_ranks,
             "trainer_shard_state": trainer_shard_state_ranks,
             "accelerate_shard_state": accelerate_shard_state_ranks,
             "lightning_shard_state": lightning_shard_state_ranks}
