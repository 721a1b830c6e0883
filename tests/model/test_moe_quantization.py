"""Quantized experts (--quantization wint8|wint4 on a mixture of experts): every routed
expert becomes two quantized linear layers (layers/fused_moe.py: QuantizedExpert), made
in the loader from the whole checkpoint tensor, as the dense linears are.

The proof: a tiny ERNIE 4.5 MoE (a dense first layer, shared experts, a correction
bias) quantized by loom at load gives, token for token, transformers' greedy tokens on
the same weights quantized and dequantized by loom's rules and written back as a
checkpoint; no expert weight stays in full precision; expert parallel over two ranks
gives the same tokens."""

from __future__ import annotations

import pytest
import torch
from e2e.test_llm_correctness import DEVICE, hf_greedy, make_prompts
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.model.layers.fused_moe import FusedMoE, QuantizedExpert
from loom.model.layers.quantization import quantize_wint4, quantize_wint8
from loom.model.layers.weight_forms import QuantizedKernel
from loom.model.loader import load_hf_config, load_model

from .checkpoints import make_tiny_checkpoint
from .paged import PagedDriver

MAX_NEW_TOKENS = 8
GROUP = 32  # divides every linear's input features of the tiny ERNIE MoE (32..128)


def loom_quantize(weight: torch.Tensor, method: str) -> torch.Tensor:
    q = quantize_wint8(weight) if method == "wint8" else quantize_wint4(weight, GROUP)
    return q.dequantize()


@pytest.fixture(scope="module", params=["wint8", "wint4"])
def moe_case(request, tmp_path_factory):
    """(method, checkpoint, prompts, transformers' greedy tokens on its weights quantized
    and dequantized by loom's rules)."""
    from transformers import AutoModelForCausalLM

    method = request.param
    original = make_tiny_checkpoint("ernie4_5_moe", tmp_path_factory.mktemp(f"{method}-moe"))
    make_tiny_tokenizer(original)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)[::3]
    experts = linears = 0
    with torch.no_grad():
        unquantized = [hf_greedy(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # (E, out, in): each expert's matrix alone; rows (and their groups)
                # quantize independently, so gate|up fused equals gate and up apart
                for expert in range(param.shape[0]):
                    param[expert] = loom_quantize(param[expert], method)
                experts += 1
            elif name.endswith("_proj.weight"):  # attention, dense and shared MLPs
                param.copy_(loom_quantize(param, method))
                linears += 1
        # the embedding table (tied to the LM head or not) in wint8 under either method
        tables = {id(t): t for t in (model.get_input_embeddings().weight,
                                     model.get_output_embeddings().weight)}
        for table in tables.values():
            table.copy_(loom_quantize(table, "wint8"))
    assert experts == 4 and linears == 4 * 3 + 3 + 3 * 2  # 2 MoE layers of 3; 1 dense
    dequantized = str(tmp_path_factory.mktemp(f"{method}-moe-dequantized"))
    model.save_pretrained(dequantized, safe_serialization=True)
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    return method, original, prompts, expected, unquantized


def run_greedy(path, prompts, **kwargs):
    llm = LLM(path, device=DEVICE, max_model_len=256, enable_warm_up=False, dtype="float32",
              quantization_group_size=GROUP, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_on_dequantized_experts(moe_case):
    method, original, prompts, expected, unquantized = moe_case
    got = run_greedy(original, prompts, quantization=method, max_num_batched_tokens=64)
    for i, (tokens, want) in enumerate(zip(got, expected)):
        assert tokens == want, f"prompt {i} ({len(prompts[i])} tokens): loom {tokens} != {want}"
    if method == "wint4":  # the test has teeth: full precision gives other tokens
        assert expected != unquantized


def test_no_expert_weight_stays_in_full_precision(moe_case):
    method, original = moe_case[0], moe_case[1]
    model = load_model(original, load_hf_config(original), dtype=torch.float32,
                       quantization=method, quantization_group_size=GROUP)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and layers[0].w13_weight is None and layers[0].w2_weight is None
    for expert in layers[0].experts:
        assert isinstance(expert, QuantizedExpert)
        for linear in (expert.w13, expert.w2):
            assert linear.weight.dtype == torch.uint8 and linear.weight_format == method


def test_expert_parallel_2_gives_the_same_tokens(moe_case):
    """Experts split whole over two ranks, each quantized where it lives (wint4 only:
    the loading path is wint8's too, and two worker processes cost ~15 s)."""
    method, original, prompts, expected, _ = moe_case
    if method != "wint4":
        pytest.skip("covered by wint4")
    got = run_greedy(original, prompts[:4], quantization=method, tensor_parallel_size=2,
                     enable_expert_parallel=True)
    assert got == expected[:4]


def test_bf16_kernel_experts_follow_the_reference(moe_case):
    """bf16 on an AVX512-BF16 CPU: experts run loom's quantized_linear kernel; one
    forward's logits stay within bf16 noise of the float32 reference path's."""
    from loom.kernels import native_ops

    ops = native_ops()
    if ops is None or not ops.quant_gemm_available():
        pytest.skip("loom's quantized kernel needs the native kernels on AVX512-BF16")
    method, original = moe_case[0], moe_case[1]
    config = load_hf_config(original)
    tokens = torch.tensor(make_prompts(config.vocab_size)[6][:32])  # 64 tokens long
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(original, config, dtype=dtype, quantization=method,
                           quantization_group_size=GROUP, attention_backend="torch")
        expert = next(m for m in model.modules() if isinstance(m, FusedMoE)).experts[0]
        assert isinstance(expert.w13.form, QuantizedKernel) == (dtype == torch.bfloat16)
        driver = PagedDriver(model, num_blocks=8, block_size=16, dtype=dtype)
        logits[dtype] = driver.step([(0, tokens.tolist(), len(tokens))]).float()
    top = logits[torch.float32].argmax(-1)
    agree = (logits[torch.bfloat16].argmax(-1) == top).float().mean()
    assert agree >= 0.9, agree
