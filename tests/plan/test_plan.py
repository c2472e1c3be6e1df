"""adambridge.plan: the offload article's worked figures, parameter counts from config.json
against the real models, LoRA counts against peft's, the rows, the advice and the errors."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from adambridge.plan import PlanError, arithmetic as ar, hardware, model as plan_model, plan

# Every number given, so nothing is measured and each plan is deterministic.
MACHINE = dict(host_bw=200, host_ram=1500, numa_nodes=1)


# ---------------------------------------------------------------------------- the article's figures

def test_arithmetic_adam_state_is_12_bytes_per_param_and_84_gb_for_7b():
    assert ar.state_bytes_per_param("fp32") == 12
    assert ar.state_bytes(7e9) == pytest.approx(84e9)
    params, grads, state = ar.gpu_bytes(7e9, 7e9, state_on_gpu=True)
    assert params + grads == pytest.approx(28e9) and state == pytest.approx(84e9)


def test_arithmetic_cpu_step_moves_4_bytes_per_param_against_24_streaming_back():
    assert ar.LINK_BYTES_CPU_STEP == 4 and ar.LINK_BYTES_STREAM_BACK == 24
    assert ar.link_bytes(7e9) == pytest.approx(28e9)
    assert ar.link_seconds(ar.link_bytes(7e9), 25) == pytest.approx(1.12)       # "roughly 1.1 s"
    streamed = ar.link_bytes(7e9, ar.LINK_BYTES_STREAM_BACK)
    assert streamed == pytest.approx(168e9)
    assert 6.5 < ar.link_seconds(streamed, 25) < 7.0                            # "nearly seven seconds"


def test_arithmetic_1_5_tb_of_ram_holds_the_state_of_125b_parameters():
    assert ar.params_that_fit(1.5e12) == pytest.approx(125e9)
    assert ar.host_ram_bytes(125e9, "fp32", pinned=False) == pytest.approx(1.5e12)


def test_arithmetic_backward_is_4_n_t_flops_when_every_parameter_trains():
    n, t = 7e9, 4096
    assert ar.backward_flops(n, n, t) == 4 * n * t
    assert ar.backward_flops(n, 0, t) == 2 * n * t     # frozen weights: activations' gradients only
    assert ar.compute_seconds(ar.backward_flops(n, n, t), 400) == pytest.approx(4 * n * t / 400e12)


def test_arithmetic_hiding_batch_does_not_depend_on_model_size():
    # 1.12 s of link time at 400 TFLOP/s: backward lasts that long at 16,000 tokens.
    assert ar.hiding_tokens(1.12, 7e9, 7e9, 400) == pytest.approx(16_000)
    seconds_per_param = ar.link_seconds(ar.link_bytes(1.0), 25)
    assert ar.hiding_tokens(seconds_per_param * 7e9, 7e9, 7e9, 400) == \
        pytest.approx(ar.hiding_tokens(seconds_per_param * 70e9, 70e9, 70e9, 400))


def test_arithmetic_host_update_is_bytes_touched_over_bandwidth():
    assert ar.HOST_BYTES_TOUCHED == {"fp32": 28, "bf16": 20, "fp8": 16.125}
    assert ar.host_update_seconds(7e9, "fp32", 200) == pytest.approx(0.98)     # "around a second"
    assert ar.STATE_BYTES["fp8"] == pytest.approx(6.0625)


def test_arithmetic_drive_life_and_writes_per_day():
    assert ar.drive_writes_per_day(3.84e12, 86_400, 3.84) == pytest.approx(1.0)
    assert ar.drive_life_months(1.0, 1.0) == pytest.approx(60.0)     # the 5-year rating
    assert ar.drive_life_months(60.0, 1.0) == pytest.approx(1.0)
    assert ar.nvme_seconds(7e9, 7) == pytest.approx(2.0)              # read and write


def test_arithmetic_accumulation_spreads_the_exposed_part():
    passes = ar.accumulation_for(1.0, 0.5, 0.0, target=0.05, at_least=2)
    assert passes == 40 and (passes * 0.5 + 1.0) / (passes * 0.5) <= 1.05
    assert (39 * 0.5 + 1.0) / (39 * 0.5) > 1.05
    assert ar.accumulation_for(1e6, 0.5, 0.0, target=0.05, at_least=2) is None


def test_plan_rows_carry_the_article_figures_for_7b():
    p = plan(params=7e9, gpu="A100-80GB", tokens_per_step=16_000, **MACHINE)
    base, bf16 = p.row("all-GPU"), p.row("AdamBridge bf16 moments")
    assert (base.gpu_params_gb + base.gpu_grads_gb, base.gpu_state_gb) == pytest.approx((28, 84))
    assert (bf16.gpu_state_gb, bf16.link_gb, bf16.link_s) == pytest.approx((0, 28, 1.12))
    assert bf16.backward_s == pytest.approx(4 * 7e9 * 16_000 / 125e12)
    assert bf16.host_ram_gb == pytest.approx(7e9 * (8 + 4) / 1e9)               # state + pinned
    assert p.row("AdamBridge fp32").host_ram_gb == pytest.approx(7e9 * 16 / 1e9)


def test_plan_lora_on_7b_takes_the_state_under_a_gigabyte(tmp_path):
    llama_7b = dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                    num_hidden_layers=32, num_attention_heads=32, vocab_size=32000,
                    tie_word_embeddings=False)
    path = _write(tmp_path, llama_7b)
    # (activations given as none: this is about the optimizer state alone)
    full = plan(model=path, gpu="RTX4090", activations_gb=0, **MACHINE)
    lora = plan(model=path, gpu="RTX4090", lora_rank=16, lora_targets="q_proj,v_proj",
                activations_gb=0, **MACHINE)
    assert full.row("all-GPU").gpu_state_gb > 80
    assert lora.model.trainable == 32 * 2 * 16 * (4096 + 4096)
    assert lora.row("all-GPU").gpu_state_gb < 1.0
    assert lora.advice.setup == "all-GPU AdamW" and full.advice.setup != "all-GPU AdamW"


# ---------------------------------------------------------------------------- counting a config.json

TINY = {
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2,
                 n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0),
    "gpt2-untied": dict(model_type="gpt2", n_embd=32, n_layer=3, n_head=2, vocab_size=50,
                        n_positions=16, n_inner=48, tie_word_embeddings=False, bos_token_id=0,
                        eos_token_id=0),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False),
    "llama-tied-bias": dict(model_type="llama", hidden_size=48, intermediate_size=80,
                            num_hidden_layers=3, num_attention_heads=4, vocab_size=64,
                            tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True),
}


def _write(tmp_path, config: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def _real_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))


@pytest.mark.parametrize("arch", sorted(TINY))
def test_model_config_count_equals_the_real_models(tmp_path, arch):
    real = sum(p.numel() for p in _real_model(TINY[arch]).parameters())
    counted = plan_model.count_config(_write(tmp_path, TINY[arch]))
    assert counted.total == real and counted.source.startswith("counted on the meta device")
    assert plan_model.formula_count(TINY[arch]).total == real        # without transformers


def test_model_config_counts_by_formula_without_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)           # import transformers fails
    counted = plan_model.count_config(_write(tmp_path, TINY["llama"]))
    assert counted.total == 74560 and "transformers is not installed" in counted.source


def test_model_config_of_unknown_type_uses_the_formula_or_names_the_field(tmp_path):
    mystery = dict(TINY["llama"], model_type="mystery-lm")
    mystery.pop("architectures")
    counted = plan_model.count_config(_write(tmp_path, mystery))
    assert counted.total == 74560 and "does not know model_type 'mystery-lm'" in counted.source
    mystery.pop("intermediate_size")
    with pytest.raises(PlanError, match=r"^Invalid model \(--model\): .*config.json has no "
                                        r"'intermediate_size'.*give --params instead$"):
        plan_model.count_config(_write(tmp_path, mystery))


def test_model_config_folder_is_read_too(tmp_path):
    _write(tmp_path, TINY["gpt2"])
    assert plan_model.count_config(tmp_path).total == 108544


@pytest.mark.parametrize("arch, targets", [
    ("gpt2", ["c_attn", "c_proj"]), ("llama", ["q_proj", "v_proj"]), ("llama", "all-linear"),
    ("qwen2", ["q_proj", "k_proj", "down_proj"]), ("gpt2-untied", "all-linear"),
], ids=["gpt2 c_attn,c_proj", "llama q,v", "llama all-linear", "qwen2 q,k,down", "gpt2 untied all-linear"])
def test_model_lora_count_equals_peft(tmp_path, monkeypatch, arch, targets):
    from peft import LoraConfig, get_peft_model
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's fan_in_fan_out note for GPT-2's Conv1D
        peft_model = get_peft_model(_real_model(TINY[arch]), LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    given = targets if isinstance(targets, str) else ",".join(targets)
    facts = plan_model.model_facts(model=_write(tmp_path, TINY[arch]), lora_rank=4, lora_targets=given)
    assert (facts.trainable, facts.total) == (trainable, total)
    monkeypatch.setitem(sys.modules, "transformers", None)          # the formula's layers agree
    facts = plan_model.model_facts(model=_write(tmp_path, TINY[arch]), lora_rank=4, lora_targets=given)
    assert (facts.trainable, facts.total) == (trainable, total)


@pytest.mark.parametrize("text, count", [("7e9", 7e9), ("7B", 7e9), ("494M", 494e6),
                                         ("1.5T", 1.5e12), ("70k", 7e4), (125, 125)])
def test_model_parse_count_takes_suffixes(text, count):
    assert plan_model.parse_count("params", text) == pytest.approx(count)


def test_model_trainable_fraction_or_count():
    assert plan(params=1e9, trainable=0.25, gpu="H100", **MACHINE).model.trainable == 250_000_000
    assert plan(params=1e9, trainable="100M", gpu="H100", **MACHINE).model.trainable == 100_000_000


# ---------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, message", [
    (dict(params=0), r"^Invalid params \(--params\): 0 \(expected a number > 0\)$"),
    (dict(params=-7e9), r"^Invalid params \(--params\): -7000000000.0 \(expected a number > 0\)$"),
    (dict(params="seven"), r"^Invalid params \(--params\): 'seven' \(expected a number such as 7e9"),
    (dict(params=None), r"^Invalid params \(--params\) / model \(--model\): give exactly one"),
    (dict(tokens_per_step=0), r"^Invalid tokens_per_step \(--tokens-per-step\): 0 "),
    (dict(tokens_per_step=100, accumulation=200), r"^Invalid accumulation \(--accumulation\): 200 "
                                                  r"\(more passes than the 100 tokens per step\)$"),
    (dict(gpus=0), r"^Invalid gpus \(--gpus\): 0 \(expected a number >= 1\)$"),
    (dict(gpus=1.5), r"^Invalid gpus \(--gpus\): 1.5 \(expected a whole number\)$"),
    (dict(parallel="zero3"), r"^Invalid parallel \(--parallel\): 'zero3' \(one of ddp, fsdp2\)$"),
    (dict(gpu="H300"), r"^Unknown gpu \(--gpu\): 'H300' \(known: H200, H100-PCIe, H100, A100-80GB, "
                       r"A100-40GB, L40S, L4, RTX4090, RTX5090-Laptop; "),
    (dict(gpu_memory=-1), r"^Invalid gpu_memory \(--gpu-memory\): -1 \(expected a number > 0\)$"),
    (dict(link_gbps=0), r"^Invalid link_gbps \(--link-gbps\): 0 "),
    (dict(host_bw=-5), r"^Invalid host_bw \(--host-bw\): -5 \(expected a number > 0\)$"),
    (dict(host_ram=0), r"^Invalid host_ram \(--host-ram\): 0 "),
    (dict(host_reserve=1), r"^Invalid host_reserve \(--host-reserve\): 1 \(expected a number >= 0 and < 1\)$"),
    (dict(drive_tb=0), r"^Invalid drive_tb \(--drive-tb\): 0 "),
    (dict(trainable="20B"), r"^Invalid trainable \(--trainable\): '20B' \(more than the model's "
                           r"7,000,000,000 parameters\)$"),
    (dict(lora_rank=16, lora_targets="q_proj"), r"^Invalid lora_rank \(--lora-rank\): 16 \(LoRA needs "
                                                r"--model \(a config.json\)"),
    (dict(lora_rank=16), r"^Invalid lora_rank \(--lora-rank\) / lora_targets \(--lora-targets\): a "
                         r"LoRA plan needs both"),
], ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
def test_plan_bad_input_is_one_line_naming_the_argument(kwargs, message):
    given = dict(dict(params=7e9, gpu="H100", **MACHINE), **kwargs)
    with pytest.raises(PlanError, match=message) as caught:
        plan(**given)
    assert "\n" not in str(caught.value)


def test_plan_lora_targets_that_match_nothing_name_the_layers(tmp_path):
    with pytest.raises(PlanError, match=r"^Invalid lora_targets \(--lora-targets\): 'qkv' \(matches "
                                        r"no linear layer of the model; its layers end in c_attn, "
                                        r"c_fc, c_proj, lm_head\)$"):
        plan(model=_write(tmp_path, TINY["gpt2"]), lora_rank=4, lora_targets="qkv", gpu="H100", **MACHINE)


def test_plan_without_gpu_and_without_cuda_names_the_choices(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_device", lambda: None)
    with pytest.raises(PlanError, match=r"^Invalid gpu \(--gpu\): none given and torch sees no CUDA "
                                        r"device here; choose one of H200, .*, or give --gpu-memory GB for another card$"):
        plan(params=7e9, **MACHINE)


def test_plan_detected_card_is_the_default_and_unknown_cards_need_numbers(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_device", lambda: ("NVIDIA H100 80GB HBM3", 85.0))
    found = plan(params=7e9, **MACHINE).gpu
    assert (found.name, found.memory_gb, found.tflops) == ("H100", 85.0, 400)
    monkeypatch.setattr(hardware, "cuda_device", lambda: ("NVIDIA B999", 200.0))
    with pytest.raises(PlanError, match=r"^Invalid gpu \(--gpu\): cuda:0 'NVIDIA B999' is not in the "
                                        r"table; give --gpu-tflops, --link-gbps, --hbm-gbps or --gpu"):
        plan(params=7e9, **MACHINE)
    spec = plan(params=7e9, gpu_tflops=900, link_gbps=100, hbm_gbps=6000, **MACHINE).gpu
    assert (spec.memory_gb, spec.tflops, spec.link_gbps) == (200.0, 900, 100)


@pytest.mark.parametrize("desc,given,name,link,defaults", [
    ("memory alone: a generic card, every default named", dict(gpu_memory=12), "a 12 GB GPU", 25.0,
     r"defaults, not this card's: 50 TFLOP/s, memory 480 GB/s, link 25 GB/s \(PCIe Gen4 x16\) "
     r"\(give --gpu-tflops, --hbm-gbps, --link-gbps for yours\)"),
    ("its name and link given: those are not defaults", dict(gpu_memory=32, gpu_name="RTX 5090",
                                                            link_gbps=50), "RTX 5090", 50.0,
     r"defaults, not this card's: 50 TFLOP/s, memory 480 GB/s \(give --gpu-tflops, --hbm-gbps "
     r"for yours\); given: --gpu-memory 32, --link-gbps 50; named by --gpu-name$"),
])
def test_plan_gpu_memory_plans_a_card_not_in_the_table(monkeypatch, desc, given, name, link, defaults):
    monkeypatch.setattr(hardware, "cuda_device", lambda: None)
    spec = plan(params=1e9, **given, **MACHINE).gpu
    assert (spec.name, spec.memory_gb, spec.link_gbps) == (name, given["gpu_memory"], link), desc
    assert spec.source.startswith("not in the table; ") and re.search(defaults, spec.source), spec.source


def test_plan_gpu_name_renames_a_table_card_and_refuses_an_empty_one():
    spec = plan(params=1e9, gpu="RTX4090", gpu_memory=12, gpu_name="RTX 4070 Ti", **MACHINE).gpu
    assert (spec.name, spec.memory_gb, spec.tflops) == ("RTX 4070 Ti", 12, 66)
    with pytest.raises(PlanError, match=r"^Invalid gpu_name \(--gpu-name\): ' ' \(expected the card's name"):
        plan(params=1e9, gpu="RTX4090", gpu_name=" ", **MACHINE)


@pytest.mark.parametrize("desc,params,activations,reason", [
    ("activations alone over the card", 494e6, 14.4,
     r"the activations alone \(14\.4 GB at 4,096 tokens per backward\) fill the 10\.8 GB usable: "
     r"fewer tokens per backward or activation checkpointing first$"),
    ("activations and weights together", 494e6, 10.0,
     r"the activations \(10\.0 GB at 4,096 tokens per backward\) with the bf16 weights \(0\.99 GB\) "
     r"leave no room for any trainable parameter"),
    ("the weights themselves", 6e9, 0.5, r"the bf16 weights alone do not leave room"),
])
def test_advice_first_reason_names_what_leaves_no_room(desc, params, activations, reason):
    p = plan(params=params, gpu="RTX4090", gpu_memory=12, activations_gb=activations, **MACHINE)
    first = p.advice.reasons[0]
    assert first.startswith("1. trainable: ") and re.search(reason, first), (desc, first)


@pytest.mark.parametrize("name", ["rtx 4090", "RTX-4090", "NVIDIA GeForce RTX 4090", "rtx5090 laptop",
                                  "NVIDIA GeForce RTX 5090 Laptop GPU", "a100-sxm4-40gb"])
def test_hardware_gpu_names_in_any_spelling(name):
    assert hardware.table_gpu(name) is not None


# ---------------------------------------------------------------------------- the rows and the advice

def test_plan_is_deterministic_for_given_inputs():
    a = plan(params=13e9, gpu="L40S", gpus=4, tokens_per_step=8192, **MACHINE).to_dict()
    b = plan(params=13e9, gpu="L40S", gpus=4, tokens_per_step=8192, **MACHINE).to_dict()
    assert a == b and json.dumps(a)


def test_advice_follows_the_article_order_and_accumulates_to_the_hiding_batch():
    p = plan(params=7e9, gpu="H100", tokens_per_step=4096, **MACHINE)
    assert [r[:2] for r in p.advice.reasons] == ["1.", "2.", "3.", "4.", "5.", "6."]
    assert p.advice.setup.startswith("AdamBridge") and p.advice.accumulation > 1
    assert "train fewer parameters first" in p.advice.reasons[0]
    accumulated = plan(params=7e9, gpu="H100", tokens_per_step=4096 * p.advice.accumulation,
                       accumulation=p.advice.accumulation, **MACHINE)
    assert accumulated.row(p.advice.setup).vs_all_gpu <= 1.05
    hidden = plan(params=7e9, gpu="H100", tokens_per_step=64_000, **MACHINE)
    assert hidden.advice.accumulation is None and "already hide" in hidden.advice.reasons[3]


def test_advice_all_gpu_when_it_fits_and_fsdp2_when_sharding_fits():
    small = plan(params=1e9, gpu="H100", **MACHINE)
    assert small.advice.setup == "all-GPU AdamW" and "it fits" in small.advice.summary
    two = plan(params=7e9, gpu="H100", gpus=2, **MACHINE)
    assert two.advice.summary.startswith("all-GPU AdamW with FSDP2 over your 2 GPUs")


def test_advice_shards_the_state_over_ranks_under_ddp():
    # 13B on two H100s: the bf16 weights and DDP's gradients (52 GB) fit one, all-GPU AdamW
    # does not fit two with FSDP2 (104 GB each): the host state is sharded over the ranks
    p = plan(params=13e9, gpu="H100", gpus=2, tokens_per_step=8192, **MACHINE)
    names = [r.name for r in p.rows]
    assert any("state sharded x2" in n for n in names) and p.advice.setup.endswith("sharded x2")
    sharded = next(r for r in p.rows if r.kind == "sharded")
    single = p.row(f"AdamBridge {sharded.precision} moments")
    assert sharded.host_ram_gb == pytest.approx(single.host_ram_gb / 2)
    assert sharded.link_gb == pytest.approx(single.link_gb / 2)
    assert "shard_state=True" in p.advice.reasons[1]


def test_advice_never_suggests_sharding_the_state_beside_a_gpu_that_cannot_fit():
    # 70B on eight H100s under DDP: every rank holds the 140 GB of weights, so no AdamBridge
    # setup fits the GPU; sharding the host state would not help, and the advice must not say so
    p = plan(params=70e9, gpu="H100", gpus=8, tokens_per_step=8192, **MACHINE)
    text = "\n".join(p.advice.reasons)
    assert "none helps" in text and "shard_state" not in text
    assert p.advice.summary.startswith("nothing fits this GPU")


def test_advice_nvme_last_when_the_state_exceeds_ram():
    p = plan(params=7e9, gpu="H100", host_bw=100, host_ram=64, numa_nodes=1, nvme_gbps=14,
             drive_tb=7.68, dwpd=3)
    assert p.advice.setup.startswith("AdamBridge fp8, NVMe") and "5. NVMe:" in p.advice.reasons[-1]
    row = p.row("AdamBridge fp8, NVMe")
    state = 7e9 * ar.STATE_BYTES["fp8"]
    assert row.nvme_gb * 1e9 + (row.host_ram_gb * 1e9 - 7e9 * 4 - 9 * 2**18 * ar.STATE_BYTES["fp8"]) \
        == pytest.approx(state)
    assert row.nvme_s == pytest.approx(2 * row.nvme_gb / 14)
    assert row.drive_life_months == pytest.approx(
        ar.drive_life_months(ar.drive_writes_per_day(row.nvme_gb * 1e9, row.step_s, 7.68), 3))


def test_plan_numa_nodes_share_the_bandwidth_between_gpus():
    one = plan(params=7e9, gpu="H100", host_bw=200, host_ram=1500, numa_nodes=2).row("AdamBridge bf16")
    two = plan(params=7e9, gpu="H100", host_bw=200, host_ram=1500, numa_nodes=1).row("AdamBridge bf16")
    assert one.host_update_s == pytest.approx(2 * two.host_update_s)


def test_plan_fsdp2_rows_are_synchronous_and_have_no_nvme_row():
    p = plan(params=70e9, gpu="H100", gpus=8, parallel="fsdp2", host_ram=500, host_bw=200,
             numa_nodes=1)
    row = p.row("AdamBridge bf16 moments")
    assert row.exposed_s == pytest.approx(row.link_s + row.host_update_s) and row.hiding_tokens is None
    assert row.gpu_params_gb == pytest.approx(70e9 * 2 / 8 / 1e9)
    assert p.row("AdamBridge").note and not any(r.kind == "nvme" for r in p.rows)
    # the state does not fit 500 GB: the advice names the refusal instead of a row
    assert p.advice.reasons[-1] == "4. NVMe: refused: the NVMe tier does not take FSDP2 parameters"
