"""Paged prefill + chunked prefill + batched decode match transformers' forward."""

from __future__ import annotations

import logging

import pytest
import torch

from loom.envs import settings
from loom.model.loader import (get_model_architecture, kv_cache_bytes_per_block,
                               load_hf_config, load_model)

from .checkpoints import FAMILIES, MOE_FAMILIES, NATIVE_FAMILIES, make_tiny_checkpoint
from .paged import PagedDriver

ATOL = 1e-4


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = hf_logits.cache.get(path)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_logits.cache[path] = model
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


hf_logits.cache = {}


def run_scenario(model, vocab_size: int, seed: int = 0, solo_decodes: int = 0,
                 driver: PagedDriver | None = None,
                 first_id: int = 0) -> list[tuple[list[int], torch.Tensor, int]]:
    """Three prompts (5, 11, 7 tokens), request 1 prefilled in two chunks, a mixed
    step (chunk + decode), then three batched decode steps with greedy tokens, then
    ``solo_decodes`` steps of request 0 alone (batch 1); on ``driver``'s KV cache if
    given, as requests ``first_id`` on.
    Returns ``(context, logits of the new tokens, num_new)`` per request per step."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 7)]
    driver = driver or PagedDriver(model, num_blocks=48, block_size=4, seed=seed)
    records = []

    def run(work):
        logits = driver.step([(first_id + i, tokens, n) for i, tokens, n in work])
        offset = 0
        for _, tokens, num_new in work:
            records.append((list(tokens), logits[offset:offset + num_new], num_new))
            offset += num_new
        return logits

    seqs = [list(p) for p in prompts]
    # step 1: request 0 and 2 whole, request 1 first chunk of 6
    run([(0, seqs[0], 5), (1, seqs[1][:6], 6), (2, seqs[2], 7)])
    seqs[0].append(int(records[0][1][-1].argmax()))
    # step 2: request 0 decodes while request 1 finishes its prefill (mixed batch)
    run([(0, seqs[0], 1), (1, seqs[1], 5)])
    seqs[0].append(int(records[-2][1][-1].argmax()))
    seqs[1].append(int(records[-1][1][-1].argmax()))
    seqs[2].append(int(records[2][1][-1].argmax()))
    # steps 3-5: all three decode together
    for _ in range(3):
        logits = run([(i, seqs[i], 1) for i in range(3)])
        for i in range(3):
            seqs[i].append(int(logits[i].argmax()))
    for _ in range(solo_decodes):
        seqs[0].append(int(run([(0, seqs[0], 1)])[0].argmax()))
    return records


@pytest.fixture(params=["native", "torch_ops"])
def kernels(request, monkeypatch):
    """Run with loom's native CPU kernels, and again with the PyTorch ops that stand
    in for them (no compiler, LOOM_NATIVE_KERNELS=0, CUDA)."""
    import loom.kernels

    if request.param == "torch_ops":
        monkeypatch.setattr(loom.kernels, "_module", None)
    else:
        assert loom.kernels.native_ops() is not None
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_forward_matches_transformers(checkpoints, family, kernels):
    path = checkpoints[family]
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.float32, device=torch.device("cpu"))
    records = run_scenario(model, config.vocab_size)
    assert len(records) == 3 + 2 + 9
    for tokens, logits, num_new in records:
        assert logits.shape == (num_new, config.vocab_size) and logits.dtype == torch.float32
        expected = hf_logits(path, tokens)[-num_new:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_bfloat16_runs_close(checkpoints, kernels):
    path = checkpoints["qwen3"]
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32
    tokens = list(range(5, 17))
    driver = PagedDriver(model, dtype=torch.bfloat16)
    logits = driver.step([(0, tokens, len(tokens))])
    expected = hf_logits(path, tokens)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.fixture
def record_at_once(monkeypatch):
    """Record a forward at its shape's first sighting (serving waits for the second),
    so that a short scenario replays every shape it runs twice."""
    from loom.model import kernel_replay

    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_replayed_forward_equals_the_modules(checkpoints, family, monkeypatch, record_at_once):
    """bf16 on the CPU: the forward replayed from loom's kernels (kernel_replay.py)
    gives the modules' logits bit for bit, through prefill chunks, mixed steps and
    decodes (batch 3 and 1), for every family (Qwen2's qkv bias, Qwen3's q/k norm, tied
    embeddings, llama3 rope, Mistral's sliding window, and the mixtures of experts:
    Qwen3-MoE, Mixtral, ERNIE-MoE's shared experts, correction bias and dense first
    layer), and counts the same tokens per expert."""
    _replay_equals_the_modules(checkpoints, family, monkeypatch, "none")


@pytest.mark.parametrize("family,quantization", [("qwen3_moe", "wint8"),
                                                 ("ernie4_5_moe", "wint4")])
def test_replay_runs_quantized_experts_as_the_modules(checkpoints, family, quantization,
                                                      monkeypatch, record_at_once):
    """Quantized experts (QuantizedExpert, loom's quantized_linear) and quantized shared
    experts and dense layers: the replay equals the modules bit for bit too."""
    from loom.kernels import native_ops

    ops = native_ops()
    if ops is None or not ops.quant_gemm_available():
        pytest.skip("loom's quantized kernel needs the native kernels on AVX512-BF16 or AVX2")
    _replay_equals_the_modules(checkpoints, family, monkeypatch, quantization)


def _replay_equals_the_modules(checkpoints, family, monkeypatch, quantization):
    """The scenario twice on one KV cache (new requests, the same shapes): the first
    pass records each shape, the second replays every one of them."""
    from loom.kernels import native_ops
    from loom.model.layers.fused_moe import FusedMoE

    ops = native_ops()
    # a quantized model needs only the quantized kernel (AVX2 CPUs have it)
    quantized = quantization not in (None, "none")
    if ops is None or not (ops.bf16_gemm_available() or quantized and ops.quant_gemm_available()):
        pytest.skip("no native bf16 kernels on this CPU")
    path = checkpoints[family]
    config = load_hf_config(path)
    results, expert_tokens = {}, {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LOOM_NATIVE_LAYERS", setting)
        settings.cache_clear()  # loom.envs reads the environment once
        model = load_model(path, config, dtype=torch.bfloat16, quantization=quantization)
        driver = PagedDriver(model, num_blocks=48, block_size=4, dtype=torch.bfloat16)
        results[setting] = [*run_scenario(model, config.vocab_size, solo_decodes=2,
                                          driver=driver),
                            *run_scenario(model, config.vocab_size, seed=1, solo_decodes=2,
                                          driver=driver, first_id=3)]
        replay = getattr(model, "kernel_replay", None)
        assert (replay is not None) == (setting == "1")
        if replay is not None:
            assert replay.refusal is None
            assert replay.stats.replayed >= 7  # the second pass: every step
        moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
        expert_tokens[setting] = [(m.tokens_per_expert.tolist(), m._forwards) for m in moe]
    for (_, python, _), (_, native, _) in zip(results["0"], results["1"]):
        assert torch.equal(python, native)
    assert expert_tokens["0"] == expert_tokens["1"]
    assert (len(expert_tokens["1"]) > 0) == (family in MOE_FAMILIES)


def test_replay_adds_row_parallel_biases_as_the_modules_do(tmp_path, monkeypatch,
                                                           record_at_once):
    """A Llama with attention and MLP biases: o_proj and down_proj add theirs after the
    bf16 rounding of the product (as a row-parallel layer adds it after the all-reduce);
    the replay does the same, bit for bit with the modules."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from loom.kernels import native_ops

    from .checkpoints import _COMMON

    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no native bf16 kernels on this CPU")
    config = LlamaConfig(**_COMMON, vocab_size=256, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LOOM_NATIVE_LAYERS", setting)
        settings.cache_clear()  # loom.envs reads the environment once
        model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), dtype=torch.bfloat16)
        driver = PagedDriver(model, dtype=torch.bfloat16)
        logits[setting] = [driver.step([(0, list(range(5, 5 + n)), n if n == 7 else 1)])
                           for n in (7, 8, 9, 10)]
        replay = getattr(model, "kernel_replay", None)
        assert (replay is not None and replay.stats.replayed == 2) == (setting == "1")
    for python, native in zip(logits["0"], logits["1"]):
        assert torch.equal(python, native)


def test_replay_says_why_it_does_not_apply(checkpoints, caplog, record_at_once):
    """float32 (ATen's matmul) and Gemma 3 (a GELU): the modules run, and the model says
    so once, with the op that has no native kernel."""
    for family, dtype, op in (("llama", torch.float32, "torch.linear"),
                              ("gemma3", torch.bfloat16, "torch.")):
        path = checkpoints[family]
        model = load_model(path, load_hf_config(path), dtype=dtype)
        driver = PagedDriver(model, dtype=dtype)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="loom.model.kernel_replay"):
            for n in (7, 8, 9):
                driver.step([(0, list(range(5, 5 + n)), n if n == 7 else 1)])
        replay = model.kernel_replay
        assert replay.stats.replayed == 0 and replay.stats.recorded == 0
        assert replay.refusal.startswith(f"the forward called {op}"), replay.refusal
        said = [r.getMessage() for r in caplog.records]
        assert said == [f"forward: PyTorch modules, as {replay.refusal}"]


def test_registry_and_sizes(checkpoints):
    config = load_hf_config(checkpoints["qwen2"])
    assert get_model_architecture(config) == "Qwen2ForCausalLM"
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_architecture(config)
    config = load_hf_config(checkpoints["llama"])
    model = load_model(checkpoints["llama"], config)
    assert model.num_attention_layers == 2
    assert model.kv_cache_shape(10, 4) == (2, 2, 10, 4, 16)
    # 2 layers * K,V * 4 tokens * 2 kv heads * 16 dims * 4 bytes
    assert kv_cache_bytes_per_block(config, 4, torch.float32, 1) == 2 * 2 * 4 * 2 * 16 * 4
    assert kv_cache_bytes_per_block(config, 4, torch.bfloat16, 2) == 2 * 2 * 4 * 1 * 16 * 2


def test_tied_embeddings_share_weight(checkpoints):
    path = checkpoints["llama_tied_rope3"]
    model = load_model(path, load_hf_config(path))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    from loom.model.loader.safetensors_loader import safetensors_weights_iterator

    with pytest.raises(ValueError, match="safetensors"):
        next(safetensors_weights_iterator(str(tmp_path)))


def test_forward_without_kv_cache_for_profiling(checkpoints):
    """Before the KV cache exists (memory profiling) a prefill-only batch still runs:
    each request attends causally over its own new tokens."""
    from loom.model.attention.metadata import AttentionMetadata, set_forward_context

    path = checkpoints["qwen2"]
    config = load_hf_config(path)
    model = load_model(path, config)
    prompts = [list(range(3, 9)), list(range(20, 29))]
    starts = [0, 6, 15]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(15, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        block_table=torch.zeros(2, 1, dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=[6, 9], max_query_len=9, max_seq_len=9,
        block_size=4)
    input_ids = torch.tensor(prompts[0] + prompts[1])
    positions = torch.tensor(list(range(6)) + list(range(9)))
    with torch.inference_mode(), set_forward_context(metadata):
        logits = model.compute_logits(model(input_ids, positions))
    torch.testing.assert_close(logits[6:], hf_logits(path, prompts[1]), atol=ATOL, rtol=1e-4)


def test_vocab_padding_when_tp_does_not_divide_vocab():
    from loom.distributed.parallel_state import TPGroup
    from loom.model.layers.embedding import VocabParallelEmbedding

    full = torch.randn(5, 3)
    rank0 = VocabParallelEmbedding(5, 3, TPGroup(0, 2, None))
    rank1 = VocabParallelEmbedding(5, 3, TPGroup(1, 2, None))
    for layer in (rank0, rank1):
        layer.weight_loader(layer.weight, full)
    torch.testing.assert_close(rank0.weight, full[:3])
    torch.testing.assert_close(rank1.weight[:2], full[3:])
    assert torch.all(rank1.weight[2] == 0)


def test_unwritten_cache_slots_are_never_read(checkpoints):
    """Batched decode of requests with different context lengths reads only written
    slots, so the KV cache need not be zeroed: a NaN-filled cache gives the same logits."""
    path = checkpoints["llama"]
    model = load_model(path, load_hf_config(path))
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 5)]
    results = []
    for fill in (0.0, float("nan")):
        driver = PagedDriver(model, num_blocks=16, block_size=4)
        for attn in model.attention_layers:
            attn.kv_cache.fill_(fill)
        driver.step([(i, p, len(p)) for i, p in enumerate(prompts)])
        decoded = [p + [7] for p in prompts]
        results.append(driver.step([(i, p, 1) for i, p in enumerate(decoded)]))
    assert torch.isfinite(results[1]).all()
    assert torch.equal(results[0], results[1])
