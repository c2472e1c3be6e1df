"""The plan's GPU side against what a step really holds, on the CPU: the gradients alive at
once in async and sync mode (CudaTransport on a fake CUDA, every gradient's storage tracked),
the small group's device slots, the activation estimate against transformers' decoders (the
profiler's allocation records), and adambridge.plan.measure's dry path (what
scripts/gpu_check.sh runs on a GPU)."""
from __future__ import annotations

import re
import subprocess
import weakref
from pathlib import Path

import pytest
import torch

from adambridge import AdamBridge
from adambridge.pipeline import transport
from adambridge.pipeline.transport import CudaTransport
from adambridge.plan import activations, arithmetic as ar, estimate, measure
from adambridge.plan.shapes import shape_of
from _attach import attach_with
from fake_cuda import FakeCuda

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
ROOT = Path(__file__).resolve().parents[2]
MACHINE = dict(gpu="H100", host_bw=200, host_ram=1500, numa_nodes=1)
# Embedding and lm_head 64,000 elements each; q, o, gate, up, down 4,096-8,192; k, v 2,048
# and the norms 64: with small_param_threshold=4096, k, v and the norms are the small group.
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
            max_position_embeddings=512, tie_word_embeddings=False)
THRESHOLD = 4096


@pytest.fixture(scope="module")
def _transformers_loaded():
    # transformers imports its generation modules on first build, and one of them evaluates
    # ``torch.cuda.Stream | None``: build once before the fake replaces torch.cuda.Stream
    measure.build(TINY, torch.device("cpu"))


@pytest.fixture
def cuda(monkeypatch, _transformers_loaded):
    fake = FakeCuda(monkeypatch)
    # The caching allocator counts a block as free once its tensor dies, even while a copy
    # recorded on another stream still reads it (it is then reserved, not allocated): the
    # allocated bytes are what the plan's "fits" counts, so record_stream keeps nothing here.
    monkeypatch.setattr(transport, "_record_stream", lambda tensor, stream: None)
    return fake


class GradTracker:
    """Bytes of parameter gradients alive at once: each p.grad's storage from the moment it
    is accumulated until it is freed (a hook registered before the pipeline's runs first)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.alive: dict = {}
        self.peak = 0
        self._next = 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._seen)

    def _seen(self, p: torch.Tensor) -> None:
        storage = p.grad.untyped_storage()
        if any(ref() is storage for ref, _ in self.alive.values()):
            return  # accumulated into a gradient already counted
        self._next += 1
        self.alive[self._next] = (weakref.ref(storage), storage.nbytes())
        weakref.finalize(storage, self.alive.pop, self._next, None)
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))


def _tiny_model(config: dict = TINY):
    return measure.build(config, torch.device("cpu"))


def _batch(config: dict, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))


# Configurations: how the step is driven, and which of the plan's figures it must equal.
GRAD_CASES = [
    dict(desc="async, release_grads=True, one backward per step: the largest + the small group",
         hooks=True, opt=dict(), passes=1, expect="released"),
    dict(desc="async, release_grads=False: every gradient stays in p.grad",
         hooks=True, opt=dict(release_grads=False), passes=1, expect="every"),
    dict(desc="async, accumulation_steps=2: the first pass keeps every gradient",
         hooks=True, opt=dict(), passes=2, expect="every"),
    dict(desc="sync step(): every gradient until step()", hooks=False, opt=dict(), passes=1,
         expect="every"),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c["desc"] for c in GRAD_CASES])
def test_memory_gradients_alive_at_once_equal_the_plan(cuda, case):
    model = _tiny_model()
    opt = AdamBridge(model.parameters(), backend="torch", small_param_threshold=THRESHOLD, **case["opt"])
    tracker = GradTracker(model)   # (registered first: it sees each gradient before the pipeline)
    if case["hooks"]:
        attach_with(opt, model, make_transport=CudaTransport, accumulation_steps=case["passes"])
    ids = _batch(TINY)
    for _ in range(2):  # the first step is held; the second updates as gradients land
        for _ in range(case["passes"]):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    planned = estimate(model, tokens_per_step=64 * case["passes"], accumulation=case["passes"],
                       small_param_threshold=THRESHOLD, **MACHINE)
    grads = planned.model.grads
    trainable = sum(p.numel() for p in model.parameters())
    assert (grads.largest, grads.small, grads.small_params) == (64_000, 2 * 2 * 2048 + 5 * 64, 9)
    expected = {"released": ar.grad_bytes(grads.largest + grads.small),
                "every": ar.grad_bytes(trainable)}[case["expect"]]
    assert tracker.peak == expected
    if case["hooks"] and case["expect"] == "released":  # the row adds the small group's slots
        slots = opt._pipeline.lanes[torch.device("cpu")].transport._slots
        twins = sum(t.numel() * t.element_size() for d in (slots.device_grad, slots.device_out)
                    for t in d.values())
        row = planned.row("AdamBridge fp32 moments")
        assert row.gpu_grads_gb * ar.GB == pytest.approx(expected + twins)
        assert twins == 2 * ar.grad_bytes(grads.small)
    if case["hooks"]:
        opt.detach_hooks()


def test_memory_estimate_of_a_module_equals_the_plan_of_its_config(tmp_path):
    import json
    from adambridge.plan import plan
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    built = estimate(_tiny_model(), tokens_per_step=512, **MACHINE).to_dict()
    counted = plan(model=str(tmp_path), tokens_per_step=512, **MACHINE).to_dict()
    assert built["rows"] == counted["rows"] and built["advice"] == counted["advice"]
    assert built["model"]["grads"] == counted["model"]["grads"]
    assert built["model"]["source"].startswith("nn.Module LlamaForCausalLM (bfloat16;")


def test_memory_estimate_of_a_plain_module_counts_its_gradients_and_says_what_it_cannot():
    from adambridge.plan import PlanError
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 10))  # fp32
    planned = estimate(model, tokens_per_step=512, **MACHINE)
    grads = planned.model.grads
    assert (grads.largest, grads.small, grads.small_params) == (512 * 256, 256 + 2560 + 10, 3)
    assert planned.model.source == "nn.Module Sequential (float32; counted as bf16 weights and gradients)"
    assert planned.activations.startswith("activations: not counted on the GPU: Sequential has no .config")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(PlanError, match=r"^Invalid model: Sequential has no parameter with "
                                        r"requires_grad=True, so there is nothing to optimize$"):
        estimate(model, **MACHINE)


# ---------------------------------------------------------------------------- activations

ACTIVATION_CASES = [
    dict(desc="llama, grouped-query attention", config=dict(
        model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=2000)),
    dict(desc="qwen2, q/k/v biases, tied embeddings", config=dict(
        model_type="qwen2", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=2000, tie_word_embeddings=True)),
    dict(desc="gpt2 without dropout", config=dict(
        model_type="gpt2", n_embd=128, n_layer=4, n_head=4, vocab_size=2000, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0)),
    dict(desc="gpt2 with residual and embedding dropout (attention dropout 0: on the CPU an "
              "attention dropout sends SDPA to its math path, which keeps the scores)", config=dict(
        model_type="gpt2", n_embd=128, n_layer=4, n_head=4, n_inner=256, vocab_size=2000,
        attn_pdrop=0.0, resid_pdrop=0.1, embd_pdrop=0.1)),
]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=[c["desc"][:40] for c in ACTIVATION_CASES])
def test_memory_activation_estimate_against_a_transformers_backward(case, checkpointing):
    """The estimate against the peak bytes forward and backward allocate (gradients released
    in their hooks, so what is measured is the activations): within -5% / +20% (the bound of
    one layer's backward is generous where a layer outweighs the loss)."""
    config = dict(case["config"], max_position_embeddings=512)
    model = measure.build(config, torch.device("cpu"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = _batch(config, batch=2, seq=256)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
    measured, _ = measure.ProfilerPeak().run(step)
    shape, why = shape_of(config)
    predicted = activations.activation_bytes(shape, ids.numel(), checkpointing)
    assert not why and 0.95 <= predicted / measured <= 1.20, (predicted, measured)


def test_memory_activation_formula_on_the_paper_and_the_closing_models():
    from adambridge.plan.shapes import Shape
    # Llama-2-7B, 4,096 tokens: 32 layers of 20h + 4kd + 8I + 4a + 8 bytes per token
    llama = Shape("llama", 4096, 32, 32, 32, 128, 11008, 32000)
    assert activations.layer_bytes(llama) == 20 * 4096 + 4 * 4096 + 8 * 11008 + 4 * 32 + 8
    assert activations.activation_bytes(llama, 4096, False) / 1e9 == pytest.approx(26.41, abs=0.01)
    assert activations.activation_bytes(llama, 4096, True) / 1e9 == pytest.approx(3.04, abs=0.01)


# ---------------------------------------------------------------------------- the GPU check

def test_memory_measure_dry_path_on_the_cpu(cuda):
    """adambridge.plan.measure's comparison, as scripts/gpu_check.sh runs it on a GPU, here on
    the CPU: async mode through CudaTransport on the fake CUDA, the profiler as the meter."""
    config = dict(TINY, hidden_size=128, intermediate_size=256, vocab_size=2000)
    results = []
    for mode in measure.MODES:
        results.append(measure.compare(
            mode, config, torch.device("cpu"), batch=2, seq=256, meter=measure.ProfilerPeak(),
            attach=lambda opt, model: attach_with(opt, model, make_transport=CudaTransport),
            step_in_window=False, backend="torch", small_param_threshold=THRESHOLD))
    for result in results:
        assert abs(result.ratio - 1) <= measure.AGREEMENT, result.line()
        assert result.line().startswith(f"{result.mode}: predicted ")
    async_, sync = results
    assert async_.grads_gb < sync.grads_gb and async_.activations_gb == sync.activations_gb


def test_memory_measure_without_cuda_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU check runs for real (scripts/gpu_check.sh)")
    assert measure.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


def test_memory_gpu_check_script_parses_and_runs_the_measure_step():
    script = ROOT / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = script.read_text(encoding="utf-8")
    assert '-m adambridge.plan.measure --json "$OUT_DIR/plan_memory.json"' in text


def test_gpu_check_runs_every_file_of_gpu_tests():
    # gpu_check.sh runs tests/gpu/test_cuda_*.py, found by the glob: every test marked gpu
    # must live in such a file, or no GPU run would ever reach it (two once did not).
    text = (ROOT / "scripts" / "gpu_check.sh").read_text(encoding="utf-8")
    assert "for file in tests/gpu/test_cuda_*.py; do" in text
    uses = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*pytest\.mark\.gpu\b)",
                      re.MULTILINE)
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                    if uses.search(p.read_text(encoding="utf-8")))
    assert marked and all(m.startswith("tests/gpu/test_cuda_") for m in marked), marked


# ---------------------------------------------------------------------------- the docs' figures

LLAMA_2_7B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                  intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                  tie_word_embeddings=False)
QWEN_2_5_0_5B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                     intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                     tie_word_embeddings=True)


def _table_rows(heading: str) -> list:
    text = (ROOT / "docs" / "planning.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| Llama") or line.startswith("| Qwen")]


def test_memory_docs_table_of_two_models_on_a_24_gb_gpu_is_the_plans(tmp_path):
    import json
    from adambridge.plan import plan
    configs = {"Llama-2-7B": LLAMA_2_7B, "Qwen2.5-0.5B": QWEN_2_5_0_5B}
    rows = _table_rows("## The GPU figures of two models on a 24 GB GPU")
    assert len(rows) == 4
    for name, mode, weights, grads, acts, async_total, sync_total, all_gpu in rows:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(configs[name]))
        p = plan(model=str(folder), gpu="RTX4090", tokens_per_step=4096, host_bw=100, host_ram=256,
                 numa_nodes=1, activation_checkpointing=mode == "checkpointed")
        ours, sync = p.row("AdamBridge bf16 moments"), next(r for r in p.rows if r.kind == "sync")

        def shown(row) -> str:
            return f"{row.gpu_total_gb:.1f} ({'fits' if row.gpu_fits else 'no'})"
        digits = 1 if float(weights) >= 10 else 2
        assert weights == f"{ours.gpu_params_gb:.{digits}f}"
        assert grads == f"{ours.gpu_grads_gb:.2f} / {sync.gpu_grads_gb:.{digits}f}"
        assert acts == f"{ours.gpu_activations_gb:.1f}"
        assert (async_total, sync_total, all_gpu) == (shown(ours), shown(sync), shown(p.row("all-GPU")))


def test_memory_docs_estimate_example_runs():
    from _readme import example
    code = example("## From Python, on a built model", ROOT / "docs" / "planning.md")
    exec(compile(code, "docs/planning.md", "exec"), {})
