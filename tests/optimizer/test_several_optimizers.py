"""More than one optimizer on one model: AdamBridge beside AdamBridge or a torch optimizer.

Every run is checked against the same run with torch.optim.AdamW in place of each AdamBridge
(rtol 1e-6, atol 1e-7), and hooked (async) runs against the synchronous run bit for bit.
What cannot work is refused in one line before the refused call changes anything: one
parameter in two optimizers when either has hooks, and zero_grad() between a backward that
reached an optimizer's hooked parameters and that optimizer's step.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adambridge import AdamBridge
from _tiny import tiny_mlp

TOLERANCE = dict(rtol=1e-6, atol=1e-7)
LR = (1e-2, 3e-3)  # a different lr per optimizer, so that mixing them up shows


def _model() -> nn.Module:
    return tiny_mlp((16, 32, 8))


def _data(n: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen))
            for _ in range(n)]


def _make(kind: str, params: list, lr: float, threshold: int = 0):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return AdamBridge(params, lr=lr, weight_decay=0.01, backend="torch",
                      small_param_threshold=threshold)


def _pair(model: nn.Module, kinds: tuple, threshold: int = 0) -> tuple:
    """Two optimizers: kinds[0] on the first layer, kinds[1] on the last ('+hooks': async)."""
    parts = (list(model[0].parameters()), list(model[2].parameters()))
    opts = tuple(_make(kind.split("+")[0], part, lr, threshold)
                 for kind, part, lr in zip(kinds, parts, LR))
    for kind, opt in zip(kinds, opts):
        if kind.endswith("+hooks"):
            opt.attach_hooks(model)
    return opts


def _reference(kinds: tuple) -> tuple:
    return tuple("adamw" if kind.startswith("ab") else kind for kind in kinds)


def _train(kinds: tuple, steps: int = 4, threshold: int = 0, clip=None) -> nn.Module:
    model = _model()
    opts = _pair(model, kinds, threshold)
    for x, y in _data(steps):
        (((model(x) - y) ** 2).mean() * 30).backward()
        if clip == "all":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        elif clip == "each":
            torch.nn.utils.clip_grad_norm_(model[0].parameters(), 0.1)
            torch.nn.utils.clip_grad_norm_(model[2].parameters(), 0.05)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
    return model


def _assert_close(model: nn.Module, reference: nn.Module) -> None:
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCE)


def _assert_equal(model: nn.Module, other: nn.Module) -> None:
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


DISJOINT = [
    dict(desc="both sync", kinds=("ab", "ab"), sync=None),
    dict(desc="both with hooks", kinds=("ab+hooks", "ab+hooks"), sync=("ab", "ab")),
    dict(desc="hooks and sync", kinds=("ab+hooks", "ab"), sync=("ab", "ab")),
    dict(desc="sync and hooks", kinds=("ab", "ab+hooks"), sync=("ab", "ab")),
    dict(desc="hooks and torch SGD", kinds=("ab+hooks", "sgd"), sync=("ab", "sgd")),
]


@pytest.mark.parametrize("threshold", [0, 10 ** 6], ids=["hooked", "sent at the step"])
@pytest.mark.parametrize("case", DISJOINT, ids=lambda c: c["desc"])
def test_several_optimizers_on_disjoint_parts_update_only_their_own(case, threshold):
    model = _train(case["kinds"], threshold=threshold)
    _assert_close(model, _train(_reference(case["kinds"])))
    if case["sync"] is not None:
        _assert_equal(model, _train(case["sync"], threshold=threshold))


CLIPS = [
    dict(desc="one clip_grad_norm_ over both optimizers", clip="all"),
    dict(desc="clip_grad_norm_ over each optimizer's parameters", clip="each"),
    dict(desc="clip_grad_value_ over both optimizers", clip="value"),
]


@pytest.mark.parametrize("threshold", [0, 10 ** 6], ids=["hooked", "sent at the step"])
@pytest.mark.parametrize("case", CLIPS, ids=lambda c: c["desc"])
def test_several_optimizers_clipping_matches_torch(case, threshold):
    # Before the fix, the first case raised ('clip each optimizer's parameters separately',
    # which clips with two norms instead of one); now it takes one total norm over both.
    kinds = ("ab+hooks", "ab+hooks")
    model = _train(kinds, threshold=threshold, clip=case["clip"])
    _assert_close(model, _train(("adamw", "adamw"), clip=case["clip"]))
    _assert_equal(model, _train(("ab", "ab"), threshold=threshold, clip=case["clip"]))


def test_several_optimizers_clip_reports_the_joint_norm_in_each_step_stats():
    x, y = _data(1)[0]
    plain = _model()
    (((plain(x) - y) ** 2).mean() * 30).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
    model = _model()
    opts = _pair(model, ("ab+hooks", "ab+hooks"))
    (((model(x) - y) ** 2).mean() * 30).backward()  # the hooks take the gradients
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    for opt in opts:
        opt.step()
    assert torch.equal(total, expected)
    assert [opt.last_step_stats.grad_norm for opt in opts] == [float(total)] * 2


# -- GradScaler


INF_AT = {1: 0, 3: 2}  # step -> the layer whose output gradient becomes inf


def _train_scaled(kinds: tuple, unscale_first: bool, dtype=torch.float32, steps: int = 5):
    model = _model().to(dtype)
    opts = _pair(model, kinds)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    scales, skipped = [], []
    for i, (x, y) in enumerate(_data(steps)):
        hidden = model[0](x.to(dtype))
        if INF_AT.get(i) == 0:  # inf reaches the first optimizer's gradients only
            hidden.register_hook(lambda g: g * float("inf"))
        out = model[2](model[1](hidden))
        if INF_AT.get(i) == 2:  # inf reaches both
            out.register_hook(lambda g: g * float("inf"))
        scaler.scale(((out.float() - y) ** 2).mean()).backward()
        if unscale_first:
            scaler.unscale_(opts[0])
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        scales.append(scaler.get_scale())
        if isinstance(opts[0], AdamBridge):
            skipped.append(tuple(opt.last_step_stats.skipped for opt in opts))
    return model, scales, skipped


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step alone", "unscale_ first"])
def test_several_optimizers_grad_scaler_skips_only_the_optimizer_with_inf(unscale_first):
    reference = _train_scaled(("adamw", "adamw"), unscale_first)
    sync = _train_scaled(("ab", "ab"), unscale_first)
    hooked = _train_scaled(("ab+hooks", "ab+hooks"), unscale_first)
    _assert_close(sync[0], reference[0])
    _assert_equal(hooked[0], sync[0])
    assert sync[1] == hooked[1] == reference[1]  # one backoff per step with any inf
    assert hooked[2] == sync[2] == [(False, False), (True, False), (False, False),
                                    (True, True), (False, False)]


def test_several_optimizers_grad_scaler_fp16_params_async_equals_sync():
    sync = _train_scaled(("ab", "ab"), False, dtype=torch.float16)
    hooked = _train_scaled(("ab+hooks", "ab+hooks"), False, dtype=torch.float16)
    _assert_equal(hooked[0], sync[0])
    assert sync[1:] == hooked[1:]


@pytest.mark.parametrize("threshold", [0, 10 ** 6], ids=["hooked", "sent at the step"])
def test_several_optimizers_grad_scaler_unscale_both_then_one_clip(threshold):
    def run(kinds: tuple) -> nn.Module:
        model = _model()
        opts = _pair(model, kinds, threshold)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        for i, (x, y) in enumerate(_data(5)):
            loss = ((model(x) - y) ** 2).mean() * 30
            scaler.scale(loss * (float("inf") if i == 2 else 1.0)).backward()
            for opt in opts:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
        return model

    hooked = run(("ab+hooks", "ab+hooks"))
    _assert_close(hooked, run(("adamw", "adamw")))
    _assert_equal(hooked, run(("ab", "ab")))


def test_grad_scaler_unscale_then_clip_reaches_parameters_without_hooks():
    # One optimizer whose parameters are all under small_param_threshold: unscale_ settles
    # the step and takes their gradients out of p.grad, so a clip_grad_norm_ routed only for
    # *hooked* parameters went to torch, found no gradient and silently clipped nothing.
    def run(kind: str, hooks: bool) -> nn.Module:
        model = _model()
        opt = _make(kind, list(model.parameters()), LR[0], threshold=10 ** 6)
        if hooks:
            opt.attach_hooks(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for x, y in _data(4):
            scaler.scale(((model(x) - y) ** 2).mean() * 30).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model

    hooked = run("ab", True)
    _assert_close(hooked, run("adamw", False))
    _assert_equal(hooked, run("ab", False))


# -- one parameter in two optimizers


def _shared_pair(model: nn.Module, hooks: tuple) -> tuple:
    """The first layer's weight is in both optimizers (torch allows it: two updates a step)."""
    shared = model[0].weight
    first = _make("ab", [model[0].bias, shared], LR[0])
    second = _make("ab", [shared] + list(model[2].parameters()), LR[1])
    for opt, attach in zip((first, second), hooks):
        if attach:
            opt.attach_hooks(model)
    return first, second


def test_one_parameter_in_two_sync_optimizers_is_updated_twice_like_torch():
    runs = []
    for kind in ("ab", "adamw"):
        model = _model()
        shared = model[0].weight
        opts = (_make(kind, [model[0].bias, shared], LR[0]),
                _make(kind, [shared] + list(model[2].parameters()), LR[1]))
        for x, y in _data(3):
            ((model(x) - y) ** 2).mean().backward()
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
        runs.append(model)
    _assert_close(*runs)


@pytest.mark.parametrize("threshold", [0, 10 ** 6], ids=["hooked", "sent at the step"])
def test_one_parameter_in_two_optimizers_with_hooks_is_refused_at_attach(threshold):
    # Before the fix only a *hooked* parameter was refused: one sent at the step went to the
    # first optimizer's pipeline, which took p.grad, and the second silently skipped it.
    model = _model()
    shared = model[0].weight
    first = AdamBridge([model[0].bias, shared], backend="torch", small_param_threshold=threshold)
    second = AdamBridge([shared], backend="torch", small_param_threshold=threshold)
    first.attach_hooks(model)
    with pytest.raises(RuntimeError, match=r"^attach_hooks\(\): parameter 0 also belongs to "
                                           r"another AdamBridge optimizer with hooks attached; "
                                           r"give each optimizer its own parameters"):
        second.attach_hooks(model)
    assert second.pipeline is None


@pytest.mark.parametrize("hooked", ["first", "second"])
def test_one_parameter_in_a_sync_and_a_hooked_optimizer_is_refused_at_the_sync_step(hooked):
    # Before the fix the sync optimizer found p.grad released by the other's hooks and
    # silently skipped the shared parameter (or, hooked second, the sync step updated it
    # and the hooks updated it again from a gradient the sync step had already used).
    model = _model()
    first, second = _shared_pair(model, (hooked == "first", hooked == "second"))
    sync = second if hooked == "first" else first
    x, y = _data(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    if hooked == "first":
        first.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"^step\(\): parameter \d also belongs to another "
                                           r"AdamBridge optimizer with hooks attached, which "
                                           r"updates it; give each optimizer its own"):
        sync.step()
    _assert_equal(model, _with_values(before))
    assert not sync.state or all(int(s["step"]) == 0 for s in sync.state.values())


def _with_values(values: list) -> nn.Module:
    model = _model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)
    return model


def test_one_parameter_in_a_hooked_optimizer_and_torch_sgd_needs_release_grads_false():
    # A torch optimizer cannot be seen from the hooks; with release_grads=False p.grad stays
    # and both update the shared weight as torch would (README, "Several optimizers").
    def run(kind: str) -> nn.Module:
        model = _model()
        ours = _make(kind, list(model.parameters()), LR[0])
        if kind == "ab":
            ours.release_grads = False
            ours.attach_hooks(model)
        sgd = torch.optim.SGD([model[0].weight], lr=0.1)
        for x, y in _data(3):
            ((model(x) - y) ** 2).mean().backward()
            for opt in (ours, sgd):
                opt.step()
            for opt in (ours, sgd):
                opt.zero_grad()
        return model

    _assert_close(run("ab"), run("adamw"))


# -- backward passes of another optimizer's loss


def test_requires_grad_turned_off_after_forward_gives_no_gradient_like_torch():
    # Lightning's toggle_optimizer after the forward: autograd calls the post-accumulate
    # hook with p.grad None. Before the fix the hook crashed ('NoneType' has no 'is_sparse').
    def run(kinds: tuple) -> nn.Module:
        model = _model()
        opts = _pair(model, kinds)
        for x, y in _data(3):
            for i, opt in enumerate(opts):
                loss = ((model(x) - y) ** 2).mean() * (i + 1)
                others = model[2] if i == 0 else model[0]
                others.requires_grad_(False)  # after the forward, as a late toggle does
                opt.zero_grad()
                loss.backward()
                opt.step()
                others.requires_grad_(True)
        return model

    hooked = run(("ab+hooks", "ab+hooks"))
    _assert_close(hooked, run(("adamw", "adamw")))
    _assert_equal(hooked, run(("ab", "ab")))


def test_zero_grad_between_a_backward_and_the_step_with_hooks_is_refused():
    # GAN-style: the first loss reaches both optimizers, only the first steps, the second
    # zero_grads before its own backward. torch drops those gradients; the hooks had taken
    # them (and, after the first step, updated with them): refused at the first step.
    model = _model()
    first, second = _pair(model, ("ab+hooks", "ab+hooks"))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"^zero_grad\(\) between a backward pass and "
                                           r"step\(\): the hooks had already taken this "
                                           r"optimizer's gradients for the step; turn "
                                           r"requires_grad off"):
        second.zero_grad()
    first.step()
    for p, q in zip(list(model[2].parameters()), before[2:]):
        assert torch.equal(p, q)  # the held first step: the refused optimizer changed nothing
    second.step()  # stepping instead of dropping is still possible
    first.zero_grad()
    second.zero_grad()


# -- Lightning, manual optimization with two optimizers

class _TwoOptimizers:
    """Built lazily: lightning is an optional test dependency."""

    @staticmethod
    def module(kind: str, pattern: str):
        import lightning

        class Two(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
                self.automatic_optimization = False

            def _loss(self, x, y):
                return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)

            def training_step(self, batch, batch_idx):
                x, y = batch
                first, second = self.optimizers()
                if pattern == "joint":
                    first.zero_grad()
                    second.zero_grad()
                    self.manual_backward(self._loss(x, y))
                    first.step()
                    second.step()
                    return
                for i, opt in enumerate((first, second)):  # each loss steps one optimizer
                    self.toggle_optimizer(opt)
                    opt.zero_grad()
                    self.manual_backward(self._loss(x, y) * (i + 1))
                    opt.step()
                    self.untoggle_optimizer(opt)

            def configure_optimizers(self):
                return [_make(kind, list(self.a.parameters()), LR[0]),
                        _make(kind, list(self.b.parameters()), LR[1])]

            def train_dataloader(self):
                gen = torch.Generator().manual_seed(1)
                data = torch.utils.data.TensorDataset(torch.randn(8, 16, generator=gen),
                                                      torch.randn(8, 4, generator=gen))
                return torch.utils.data.DataLoader(data, batch_size=2)

        return Two()


@pytest.mark.parametrize("pattern", ["joint", "one loss per optimizer (toggle_optimizer)"])
def test_lightning_manual_optimization_with_two_optimizers_matches_torch(pattern):
    lightning = pytest.importorskip("lightning", reason="needs lightning (test extra)")
    from adambridge.integrations.lightning import AdamBridgeCallback

    def fit(kind: str, callbacks: list) -> nn.Module:
        module = _TwoOptimizers.module(kind, pattern)
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    enable_checkpointing=False, callbacks=callbacks)
        trainer.fit(module)
        return module

    hooked = fit("ab", [AdamBridgeCallback(async_mode=True)])
    _assert_close(hooked, fit("adamw", []))
    _assert_equal(hooked, fit("ab", [AdamBridgeCallback(async_mode=False)]))
