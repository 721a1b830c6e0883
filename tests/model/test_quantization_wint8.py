"""wint8 (issue 15): per-output-channel symmetric int8 made at load.

The math (round trip within half a step), the layers (the reference matmul equals
dequantize-then-matmul in float32 within a bound derived from its rounding steps; a
re-load re-quantizes), and the proof end to end: a tiny random Llama quantized by loom
at load gives, token for token, transformers' float32 greedy tokens on the same
weights quantized, dequantized and written back as a Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from e2e.test_llm_correctness import hf_greedy, make_prompts
from test_cli_errors import assert_one_line_error, run_loom
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.config import EngineConfig
from loom.model.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from loom.model.layers.quantization import dequantize_int8, int8_linear, quantize_int8
from loom.model.loader import load_hf_config, load_model
from loom.model.loader.model_loader import describe_weight_bytes, weight_bytes_by_dtype
from loom.model.native_stack import plan_native_stack

from .checkpoints import make_tiny_checkpoint

U32 = 2.0 ** -24  # float32 unit roundoff
U_BF16 = 2.0 ** -8
SHAPES = [(1, 1), (3, 7), (17, 33), (64, 129), (5, 1000)]  # (N outputs, K inputs)


def random_weight(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so that each row's scale matters
    rows = torch.logspace(-3, 1, shape[0])[:, None]
    return (torch.randn(shape, generator=gen) * rows).to(dtype)


# ---- (a) the quantize / dequantize math ---------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step(shape, dtype):
    weight = random_weight(shape, seed=shape[0] * 31 + shape[1], dtype=dtype)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    # each row's largest |w| lands on +-127 exactly: no range is wasted
    assert torch.equal(q.abs().amax(dim=1), torch.full((shape[0],), 127, dtype=torch.int8))
    error = (dequantize_int8(q, scale) - weight.float()).abs()
    # half a step, plus the float32 roundings of w / scale and q * scale (127 u each)
    bound = scale[:, None] * (0.5 + 256 * U32)
    assert bool((error <= bound).all()), float((error - bound).max())


def test_zero_rows_get_scale_one():
    weight = random_weight((4, 9), seed=1)
    weight[1] = 0
    weight[3] = 0
    q, scale = quantize_int8(weight)
    assert scale[1] == 1 and scale[3] == 1
    assert not q[1].any() and not q[3].any()
    assert torch.equal(dequantize_int8(q, scale)[1], torch.zeros(9))
    single = torch.zeros(2, 5)
    single[0, 3] = -0.25
    q, scale = quantize_int8(single)
    assert q[0].tolist() == [0, 0, 0, -127, 0] and scale[0] == pytest.approx(0.25 / 127)


# ---- (b) the wint8 matmul against dequantize-then-matmul in float32 ------------------

def matmul_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 reference: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """|int8_linear - reference| elementwise: both sum K float32 products in some order
    (gamma_K each) and round the weight's scale in once (u each); bf16 output rounds the
    float32 result once more (half a bf16 step)."""
    k = x.shape[-1]
    magnitude = x.float().abs() @ weight.abs().t()
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    bound = (2 * k + 4) * U32 * magnitude
    if out_dtype == torch.bfloat16:
        bound = bound + U_BF16 * reference.abs()
    return bound + 1e-30


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_dequantize_then_matmul(shape, rows, dtype):
    n, k = shape
    q, scale = quantize_int8(random_weight(shape, seed=n + k))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    dequantized = dequantize_int8(q, scale)  # float32
    for b in (None, bias):
        got = int8_linear(x, q, scale, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        reference = F.linear(x.float(), dequantized, None if b is None else b.float())
        error = (got.float() - reference).abs()
        bound = matmul_bound(x, dequantized, b, reference, dtype)
        assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wint8_layers_hold_int8_and_match_the_reference(dtype):
    torch.set_default_dtype(dtype)
    try:
        column = ColumnParallelLinear(33, 17, bias=True, quantization="wint8")
        row = RowParallelLinear(17, 9, bias=True, quantization="wint8")
    finally:
        torch.set_default_dtype(torch.float32)
    weights = {}
    for layer, seed in ((column, 1), (row, 2)):
        weight = random_weight(tuple(layer.weight.shape), seed, dtype)
        bias = torch.randn(layer.weight.shape[0]).to(dtype)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        layer.process_weights_after_loading()
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        assert layer.packed_weight is None  # no bf16 copy for the CPU matmul either
        assert {p.dtype for p in layer.parameters()} == {torch.int8, torch.float32, dtype}
        weights[id(layer)] = (weight, bias)
    x = torch.randn(5, 33).to(dtype)
    y = row(column(x))
    expected_column = int8_linear(x, column.weight, column.weight_scale, column.bias)
    # the row-parallel layer adds its bias after the (all-reduced) product, as before
    expected = int8_linear(expected_column, row.weight, row.weight_scale) + row.bias
    assert torch.equal(y, expected)


def test_a_reload_requantizes_the_shards_it_is_given():
    """``load_weights`` again on a wint8 layer (its ``weight`` is int8 by then): each
    shard is quantized as a fresh load would, and the other rows keep their values."""
    layer = QKVParallelLinear(16, 4, total_num_heads=2, total_num_kv_heads=1,
                              quantization="wint8")
    shards = {name: random_weight((8 if name == "q" else 4, 16), seed)
              for seed, name in enumerate("qkv")}
    for name, tensor in shards.items():
        layer.weight.weight_loader(layer.weight, tensor, name)
    layer.process_weights_after_loading()
    before_q, before_scale = layer.weight.detach().clone(), layer.weight_scale.detach().clone()
    new_k = random_weight((4, 16), seed=99)
    layer.weight.weight_loader(layer.weight, new_k, "k")
    layer.process_weights_after_loading()  # already int8: nothing quantized twice
    fresh_q, fresh_scale = quantize_int8(new_k)
    assert layer.weight.dtype == torch.int8
    assert torch.equal(layer.weight[8:12], fresh_q)
    assert torch.equal(layer.weight_scale[8:12], fresh_scale)
    for rows in (slice(0, 8), slice(12, 16)):
        assert torch.equal(layer.weight[rows], before_q[rows])
        torch.testing.assert_close(layer.weight_scale[rows], before_scale[rows],
                                   rtol=2 * U32, atol=0)


# ---- (c) the proof: loom's wint8 == transformers on the dequantized checkpoint -------

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def wint8_case(tmp_path_factory):
    """(the original checkpoint, prompts, transformers' greedy tokens on its weights
    quantized per output row and dequantized, written back as a checkpoint)."""
    from transformers import AutoModelForCausalLM

    original = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("wint8-llama"))
    make_tiny_tokenizer(original)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)
    num_replaced = 0
    with torch.no_grad():
        unquantized = [hf_greedy(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in DECODER_LINEARS:
                # rows quantize independently: q, k, v (gate, up) one by one equal loom's
                # fused qkv_proj (gate_up_proj)
                module.weight.copy_(dequantize_int8(*quantize_int8(module.weight)))
                num_replaced += 1
    assert num_replaced == len(DECODER_LINEARS) * model.config.num_hidden_layers
    dequantized = str(tmp_path_factory.mktemp("wint8-llama-dequantized"))
    model.save_pretrained(dequantized, safe_serialization=True)
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    # the test has teeth: unquantized weights give other tokens for some prompts (2 of 13)
    assert expected != unquantized
    return original, prompts, expected


@pytest.mark.parametrize("config", [
    dict(),
    dict(enable_prefix_caching=False, max_num_batched_tokens=32),  # chunked prefills
], ids=["batched", "chunked_no_prefix_caching"])
def test_wint8_greedy_matches_transformers_on_dequantized_weights(wint8_case, config, caplog):
    original, prompts, expected = wint8_case
    with caplog.at_level(logging.INFO, logger="loom.model.loader.model_loader"):
        llm = LLM(original, dtype="float32", quantization="wint8", max_model_len=256,
                  enable_warm_up=False, **config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.engine.engine_core.get_stats()
    finally:
        llm.shutdown()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(said) == 1 and " int8" in said[0], said
    for i, (output, want) in enumerate(zip(outputs, expected)):
        got = output.outputs[0].token_ids
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens): loom {got} != {want}"
    assert (stats.prefix_cache_hits > 0) == config.get("enable_prefix_caching", True)


def test_no_full_precision_decoder_weight_stays(wint8_case):
    """After a wint8 load the decoder's linears hold int8 and scales only: the resident
    bytes are the int8 ones plus the embedding, LM head and norms in float32; the native
    stack refuses with the reason."""
    original = wint8_case[0]
    config = load_hf_config(original)
    plain = weight_bytes_by_dtype(load_model(original, config, dtype=torch.float32))
    model = load_model(original, config, dtype=torch.float32, quantization="wint8")
    totals = weight_bytes_by_dtype(model)
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * (h // config.num_attention_heads)
    linear_weights = layers * (qkv * h + h * h + 2 * i * h + h * i)
    assert totals["int8"] == linear_weights
    assert totals["float32"] == plain["float32"] - 4 * linear_weights + 4 * layers * (qkv + h + 2 * i + h)
    assert describe_weight_bytes({"int8": 3 * 2**20, "bfloat16": 2**20}) == \
        "3.0 MiB int8 + 1.0 MiB bfloat16"
    layer = model.model.layers[0]
    for module in layer.weights_by_role().values():
        if module is not None and hasattr(module, "weight_scale"):
            assert module.weight.dtype == torch.int8
    from loom.kernels import native_ops

    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no native bf16 kernels on this CPU: the stack refuses earlier")
    bf16 = load_model(original, config, dtype=torch.bfloat16, quantization="wint8")
    for decoder_layer in bf16.model.layers:
        decoder_layer.attention.kv_cache = torch.empty(0)  # planned only once bound
    attn = bf16.model.layers[0].attention
    reason = plan_native_stack(bf16.model.layers, dict(rms_norm_eps=config.rms_norm_eps),
                               torch.device("cpu"), torch.bfloat16, 1)
    assert attn.impl.name == "cpu", "the stack's backend check would come first"
    assert reason == "layer 0: the qkv weight is wint8; the stack runs bf16-packed weights"


# ---- (d) what loom cannot run fails at start-up, in one line -------------------------

def test_a_stored_quantized_checkpoint_is_refused_by_its_method(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "awq")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    run = run_loom("generate", "--model", path, "--prompt", "hi", "--device", "cpu")
    assert_one_line_error(run, "stored quantized with awq", "quant_method")


def test_bad_quantization_flags(wint8_case):
    run = run_loom("generate", "--model", wint8_case[0], "--prompt", "hi",
                   "--quantization", "bogus")
    assert_one_line_error(run, "quantization must be one of auto, none, wint8", "'bogus'")
    with pytest.raises(ValueError, match="quantization wint4 is not built yet"):
        EngineConfig.from_args(wint8_case[0], quantization="wint4", device="cpu")
