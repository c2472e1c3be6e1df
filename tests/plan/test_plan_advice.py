"""adambridge.plan's newer findings: the streamed GPU-side AdamW and which design wins, the
checkpoint peak, activation checkpointing where it is what makes a setup fit, accumulation
that would no longer fit, gap-free numbering, Hub names, counts from a config against the
real model's parameters."""
from __future__ import annotations

import json
import re
import sys

import pytest

from adambridge import cli
from adambridge.plan import PlanError, arithmetic as ar, model as plan_model, plan

MACHINE = dict(host_bw=200, host_ram=1500, numa_nodes=1)
QWEN_0_5B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True)
LLAMA_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                tie_word_embeddings=False)


def _config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _numbers(reasons) -> list:
    return [int(r.split(".", 1)[0]) for r in reasons]


# ---------------------------------------------------------------------------- which design wins

def test_arithmetic_streamed_state_crossover_is_bytes_touched_over_state_bytes():
    assert ar.streamed_crossover("fp32") == pytest.approx(28 / 12)
    assert ar.streamed_crossover("bf16") == pytest.approx(2.5)
    assert ar.streamed_link_seconds(7e9, "fp32", 25) == pytest.approx(3.36)   # 84 GB each way
    assert ar.streamed_host_seconds(7e9, "fp32", 200) == pytest.approx(0.84)  # 168 GB of DMA


@pytest.mark.parametrize("host_bw, wins", [(50, "streamed"), (400, "ours")],
                         ids=["desktop: 2x the link", "server: 16x the link"])
def test_advice_says_plainly_which_design_wins_on_the_box(tmp_path, host_bw, wins):
    p = plan(model=_config(tmp_path, QWEN_0_5B), gpu="RTX4090", tokens_per_step=4096,
             host_bw=host_bw, host_ram=256, numa_nodes=1)
    ours, streamed = p.row(p.advice.setup), next(r for r in p.rows if r.kind == "streamed")
    design = p.advice.reasons[-1]
    assert design.startswith(f"{len(p.advice.reasons)}. design: host memory gives {host_bw} GB/s per GPU")
    assert streamed.precision == ours.precision and streamed.gpu_fits
    if wins == "streamed":
        assert "our design loses here" in design and "faster" in p.advice.summary
    else:
        assert "the host step wins here" in design and "streamed" not in p.advice.summary
        assert streamed.step_s >= ours.step_s


# ---------------------------------------------------------------------------- memory advice

def test_advice_recommends_activation_checkpointing_where_it_makes_7b_fit_24_gb(tmp_path):
    path = _config(tmp_path, LLAMA_7B)
    p = plan(model=path, gpu="RTX4090", tokens_per_step=4096, **MACHINE)
    assert not any(r.fits for r in p.rows)   # 26 GB of activations on a 24 GB card
    assert p.advice.summary.startswith("AdamBridge fp32 moments with activation checkpointing "
                                       "(--activation-checkpointing)")
    assert _numbers(p.advice.reasons) == [1, 2, 3, 4]
    checkpointed = plan(model=path, gpu="RTX4090", tokens_per_step=4096,
                        activation_checkpointing=True, **MACHINE)
    row = checkpointed.row("AdamBridge fp32 moments")
    assert row.fits and f"needs {row.gpu_total_gb:,.1f} of 21.6 GB" in p.advice.reasons[3]
    assert checkpointed.advice.setup == "AdamBridge fp32 moments"
    assert row.backward_s == pytest.approx(6 * 6_738_415_616 * 4096 / 66e12)  # 2NT again
    given = plan(model=path, gpu="RTX4090", tokens_per_step=4096, activations_gb=1, **MACHINE)
    assert given.row("AdamBridge fp32 moments").gpu_activations_gb == 1.0 and given.advice.setup


def test_advice_refuses_accumulation_whose_gradients_would_not_fit(tmp_path):
    # 7B, checkpointed, on a 20 GB card: async mode fits with its released gradients
    # (17 GB), accumulating would keep all 13.5 GB of them on the device until the last pass
    p = plan(model=_config(tmp_path, LLAMA_7B), gpu="RTX4090", gpu_memory=20, tokens_per_step=1024,
             activation_checkpointing=True, **MACHINE)
    tokens = next(r for r in p.advice.reasons if " tokens: " in r)
    assert "would keep every gradient on the GPU until the last" in tokens and "does not fit" in tokens
    assert p.advice.accumulation is None
    accumulated = plan(model=_config(tmp_path, LLAMA_7B), gpu="RTX4090", gpu_memory=20,
                       tokens_per_step=2048, accumulation=2, activation_checkpointing=True, **MACHINE)
    row = accumulated.row("AdamBridge fp32 moments")
    assert row.gpu_grads_gb == pytest.approx(6_738_415_616 * 2 / 1e9)
    assert "accumulation" in row.gpu_grads_note and not row.gpu_fits


def test_plan_prints_the_checkpoint_peak_per_precision(tmp_path, capsys):
    assert cli.main(["plan", "--model", _config(tmp_path, LLAMA_7B), "--gpu", "H100",
                     "--host-bw", "200", "--host-ram", "1500", "--numa-nodes", "1"]) == 0
    out = capsys.readouterr().out
    embed = 32000 * 4096
    gb = [embed * ar.STATE_BYTES[p] / 1e9 for p in ar.PRECISIONS]   # 1.57, 1.05, 0.79
    expected = ", ".join(f"{p} +{g:,.1f} GB" if g >= 0.95 else f"{p} +{g:.2g} GB"
                         for p, g in zip(ar.PRECISIONS, gb))
    assert f"beyond what torch.optim.AdamW adds on the same path: {expected}" in out
    # an H100's backward of 4,096 tokens (0.28 s) is short against 13.5 GB of gradients over
    # half of a 50 GB/s link: about half of them still wait for their copy when it ends
    backward = 4 * 6_738_415_616 * 4096 / 400e12
    flying = ar.link_backlog_bytes(6_738_415_616 - 65 * 4096, embed, 50, backward) / 1e9
    assert f"in flight over the link when backward ends: up to {flying:,.1f} GB more" in out
    assert 6 < flying < 7
    assert re.search(r"^activations: [\d.]+ GB per GPU at the peak of a backward of 4,096 tokens", out, re.M)


# ---------------------------------------------------------------------------- model facts

def test_model_hub_name_says_nothing_is_downloaded_in_one_line(capsys):
    with pytest.raises(PlanError, match=r"^Invalid model \(--model\): 'Qwen/Qwen2.5-0.5B' \(no such "
                                        r"file or folder here; nothing is downloaded: fetch its "
                                        r"config.json first .*\)$"):
        plan(model="Qwen/Qwen2.5-0.5B", gpu="H100", **MACHINE)
    assert cli.main(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing is downloaded" in err


@pytest.mark.parametrize("config", [QWEN_0_5B, LLAMA_7B, dict(
    model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32)],
    ids=["qwen2 tied", "llama untied", "gpt2"])
def test_model_formula_sizes_every_parameter_as_transformers_builds_it(tmp_path, monkeypatch, config):
    path = _config(tmp_path, config)
    meta = plan_model.count_config(path)
    monkeypatch.setitem(sys.modules, "transformers", None)    # the formula alone
    formula = plan_model.count_config(path)
    assert sorted(formula.numels) == sorted(meta.numels) and formula.shape == meta.shape


def test_model_partly_trained_assumes_the_largest_and_every_small_one(tmp_path):
    p = plan(model=_config(tmp_path, QWEN_0_5B), trainable=0.5, gpu="H100", **MACHINE)
    grads = p.model.grads
    assert grads.assumed == plan_model.PARTLY_TRAINED
    assert grads.largest == 151936 * 896 and grads.hooked + grads.small == p.model.trainable
    assert plan_model.PARTLY_TRAINED in p.row("AdamBridge fp32 moments").gpu_grads_note
