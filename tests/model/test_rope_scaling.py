"""Rope scaling past the original context: greedy tokens equal transformers'.

A tiny Llama whose original context is 64 tokens, with each rope scaling type, serves
prompts of 5 to 150 tokens and generates past position 64 (up to ~180). For each type,
loom's greedy tokens (float32, batched, in chunks of 32; for the length-scaled types also
whole and under preemption) equal transformers' for each prompt alone, run as its
``generate`` runs it: the prompt in one forward, then one token at a time on its KV
cache (for ``dynamic`` and ``longrope`` the frequencies then follow the length: see
loom/model/layers/rotary.py).

- linear, dynamic, yarn: max_position_embeddings 64, factor 4, so max_model_len may
  reach 256 (as vLLM derives it); llama3, longrope: max_position_embeddings 256 with an
  original context of 64 (Llama 3.1's and Phi-3's configs state the extended length).
"""

from __future__ import annotations

import logging

import pytest
import torch

from loom import LLM, SamplingParams
from loom.checkpoint_defaults import derived_max_model_len, rope_scales_past
from loom.model.attention.metadata import AttentionMetadata, set_forward_context
from loom.model.layers.rotary import LengthScaledRotaryEmbedding, RotaryEmbedding, get_rope

from .checkpoints import make_tiny_checkpoint

HALF = 8  # the tiny Llama's head_dim 16: 8 frequencies
VARIANTS = {
    "linear": (64, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (64, {"rope_type": "dynamic", "factor": 3.7}),
    "yarn": (64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama3": (256, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "longrope": (256, {"rope_type": "longrope", "original_max_position_embeddings": 64,
                       "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
                       "long_factor": [1.0 + 0.9 * i for i in range(HALF)]}),
}
LENGTH_SCALED = ("dynamic", "longrope")
PROMPT_LENGTHS = (5, 40, 63, 150)
MAX_TOKENS = 32
CONFIGS = {
    # every prompt past 32 tokens in chunks, beside the others' decodes
    "chunked": dict(max_num_batched_tokens=32),
    # prompts whole, then recomputed (prompt and generated tokens) after a preemption
    "preemption": dict(num_gpu_blocks_override=20, block_size=16),
}


def rope_config(variant: str, max_positions: int | None = None):
    from transformers import LlamaConfig

    default_max_positions, params = VARIANTS[variant]
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=max_positions or default_max_positions,
                       rope_parameters=dict(params, rope_theta=10000.0))


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy generate for one request: the prompt in one forward, then a
    token at a time on its KV cache."""
    rotary = model.model.rotary_emb
    # the rotary module keeps the longest length it saw (dynamic): start each request
    # afresh, as a new process would
    rotary.inv_freq = rotary.original_inv_freq.clone()
    rotary.max_seq_len_cached = rotary.original_max_seq_len
    ids, cache = torch.tensor([prompt]), None
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(input_ids=ids, cache=cache, use_cache=True)
            cache = out.cache
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    variant = request.param
    max_positions, params = VARIANTS[variant]
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp(variant),
                                max_position_embeddings=max_positions,
                                rope_parameters=dict(params, rope_theta=10000.0))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf_model.model.rotary_emb.rope_type == variant
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist()
               for n in PROMPT_LENGTHS]
    expected = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    return variant, path, prompts, expected


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers_past_the_original_context(variant_case, config_name):
    variant, path, prompts, expected = variant_case
    if config_name == "preemption" and variant not in LENGTH_SCALED:
        pytest.skip("only a length-scaled rope could depend on which step computes a token")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", seed=0, skip_tokenizer_init=True,
             **CONFIGS[config_name]) as llm:
        # past the original 64: 256, or 64 x 3.7 for dynamic
        assert llm.engine.config.model.max_model_len == derived_max_model_len(
            rope_config(variant)) > max(PROMPT_LENGTHS) + MAX_TOKENS
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        runner = llm.engine.engine_core.executor.worker.model_runner
        rope = runner.model.model.rotary_emb
        # the cache covers max_model_len
        assert rope.cos_sin_cache.shape[1] >= llm.engine.config.model.max_model_len
        stats = llm.engine.engine_core.get_stats()
        if config_name == "preemption":
            assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
        # prefix caching would reuse keys turned at another prompt's length
        caching = llm.engine.config.cache.enable_prefix_caching
        assert caching == (variant not in LENGTH_SCALED)
    for i, output in enumerate(outputs):
        got = output.outputs[0].token_ids
        assert got == expected[i], (f"{variant}, prompt of {len(prompts[i])} tokens: "
                                    f"loom {got} != transformers {expected[i]}")


def test_length_scaled_frequencies_equal_transformers_at_every_length():
    """The frequencies each forward of transformers turns its tokens by, for every last
    position up to 300, bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for variant in LENGTH_SCALED:
        config = rope_config(variant)
        init = ROPE_INIT_FUNCTIONS[variant]
        rope = get_rope(config, 16)
        assert isinstance(rope, LengthScaledRotaryEmbedding) and rope.scales_past == 64
        original, attention_scaling = init(config)
        assert rope.attention_scaling == attention_scaling
        for length in range(1, 300):
            if length <= 64:  # transformers keeps the frequencies it started with
                expected = original
            elif variant == "dynamic":  # recomputed from the forward's max(position) + 1
                expected = init(config, seq_len=torch.tensor(length))[0]
            else:  # the long factors, computed once
                expected = init(config, seq_len=65)[0]
            assert torch.equal(rope.inv_freq_at(length), expected), (variant, length)


def test_step_turns_each_token_at_its_own_length():
    """One step of two requests: each token's cos and sin are those of its own length
    (no step-wide length, as transformers' padded batch would have); without the
    lengths (no token past the original context) the cached plain rope."""
    rope = get_rope(rope_config("dynamic"), 16)
    rope.cover(236)  # (as the loader does for max_model_len)
    positions = torch.tensor([10, 11, 99, 140])
    lengths = torch.tensor([150, 150, 100, 141])  # a prompt's chunk; two decodes
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 2, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([12, 100, 141], dtype=torch.int32),
        block_table=torch.zeros((3, 1), dtype=torch.int32), query_start_loc_cpu=[0, 2, 3, 4],
        seq_lens_cpu=[12, 100, 141], max_query_len=2, max_seq_len=141, block_size=16,
        rope_lengths=lengths)
    with set_forward_context(metadata):
        step = rope.step_inputs(positions, torch.float32)
    for i, (position, length) in enumerate(zip(positions.tolist(), lengths.tolist())):
        freqs = position * rope.inv_freq_at(length)
        assert torch.equal(step.cos[i, 0], freqs.cos()) and torch.equal(step.sin[i, 0], freqs.sin())
    assert not torch.equal(step.cos[0], step.cos[1])
    # no lengths (no forward context): the plain rope's inputs, from its cache
    plain = rope.step_inputs(positions, torch.float32)
    cached = RotaryEmbedding.step_inputs(rope, positions, torch.float32)
    assert torch.equal(plain.positions, cached.positions)
    assert (plain.cos is None) == (cached.cos is None)
    if plain.cos is None:  # the native kernel reads the cache at the positions
        assert torch.equal(plain.positions, positions)
    else:
        assert torch.equal(plain.cos, rope.cos_sin_cache[0, positions].unsqueeze(1))


def test_bfloat16_steps_past_the_context_run_eagerly_and_keep_the_replay(tmp_path):
    """On the CPU's native path a step with per-token lengths runs the modules (cos and
    sin are computed for it) without turning the replay off for the steps within the
    original context."""
    path = make_tiny_checkpoint("llama", tmp_path / "dynamic", max_position_embeddings=64,
                                rope_parameters=dict(VARIANTS["dynamic"][1], rope_theta=1e4))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(path, dtype="bfloat16", seed=0, skip_tokenizer_init=True) as llm:
        model = llm.engine.engine_core.executor.worker.model_runner.model
        replay = getattr(model, "kernel_replay", None)
        if replay is None:
            pytest.skip("loom's CPU kernels are not built here")
        outputs = llm.generate([{"prompt_token_ids": list(range(3, 33))}], params,
                               use_tqdm=False)  # positions 30..53: within 64
        within = replay.stats.replayed
        assert within > 0 and replay.refusal is None
        llm.generate([{"prompt_token_ids": list(range(3, 83))}], params, use_tqdm=False)
        assert replay.refusal is None and replay.stats.replayed == within  # eager past 64
        again = llm.generate([{"prompt_token_ids": list(range(3, 33))}], params,
                             use_tqdm=False)
        assert replay.stats.replayed > within
        assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_max_model_len_follows_rope_scaling(tmp_path, caplog):
    """vLLM's derivation: linear and dynamic scale max_position_embeddings by the factor,
    yarn its original context; llama3 and longrope state it in max_position_embeddings.
    A longer --max-model-len is one line naming the limit; a length-scaled rope turns
    prefix caching off only past its original context."""
    from loom.checkpoint_defaults import resolve_against_checkpoint
    from loom.engine_args import EngineArgs

    expected = {"linear": 256, "dynamic": 236, "yarn": 256, "llama3": 256, "longrope": 256}
    for variant, limit in expected.items():
        config = rope_config(variant)
        assert derived_max_model_len(config) == limit, variant
        assert rope_scales_past(config) == (64 if variant in LENGTH_SCALED else None)
    yarn = rope_config("yarn", max_positions=1024)  # original 64 x 4
    assert derived_max_model_len(yarn) == 256

    path = make_tiny_checkpoint("llama", tmp_path / "yarn", max_position_embeddings=64,
                                rope_parameters=dict(VARIANTS["yarn"][1], rope_theta=1e4))
    resolved = resolve_against_checkpoint(EngineArgs(model=path, skip_tokenizer_init=True))
    assert resolved.args.max_model_len == 256
    with pytest.raises(ValueError, match=r"max_model_len 300 exceeds the model's longest "
                       r"sequence 256 \(original_max_position_embeddings 64 x yarn rope "
                       r"scaling factor 4.0\); lower --max-model-len"):
        resolve_against_checkpoint(EngineArgs(model=path, max_model_len=300,
                                              skip_tokenizer_init=True))

    path = make_tiny_checkpoint("llama", tmp_path / "dynamic", max_position_embeddings=64,
                                rope_parameters=dict(VARIANTS["dynamic"][1], rope_theta=1e4))
    with caplog.at_level(logging.INFO, logger="loom.config"):
        resolved = resolve_against_checkpoint(EngineArgs(model=path, skip_tokenizer_init=True))
    assert not resolved.args.enable_prefix_caching
    assert "prefix caching off: the model's dynamic rope" in caplog.text
    resolved = resolve_against_checkpoint(EngineArgs(model=path, max_model_len=64,
                                                     skip_tokenizer_init=True))
    assert resolved.args.enable_prefix_caching


def test_hf_overrides_lay_over_the_checkpoint_config(tmp_path):
    """vLLM's --hf-overrides: a key set on the config as given (the context length here),
    and an object laid over a sub-config key by key; the workers read the overridden
    values, and a prompt past the checkpoint's own length then runs."""
    from loom.checkpoint_defaults import resolve_against_checkpoint
    from loom.engine_args import EngineArgs

    path = make_tiny_checkpoint("llama", tmp_path / "short", max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len 100 exceeds the model's"):
        resolve_against_checkpoint(EngineArgs(model=path, max_model_len=100,
                                              skip_tokenizer_init=True))
    resolved = resolve_against_checkpoint(EngineArgs(
        model=path, max_model_len=100, skip_tokenizer_init=True,
        hf_overrides='{"max_position_embeddings": 128}'))
    assert resolved.args.max_model_len == 100
    assert resolved.model_fields["hf_config"]["max_position_embeddings"] == 128
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        resolve_against_checkpoint(EngineArgs(model=path, hf_overrides="{max: 1}"))
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        resolve_against_checkpoint(EngineArgs(model=path, hf_overrides="[1]"))

    from loom.checkpoint_defaults import apply_hf_overrides
    from transformers import Gemma3Config

    nested = Gemma3Config()
    apply_hf_overrides(nested, {"text_config": {"sliding_window": 7}, "image_token_id": 5})
    assert nested.text_config.sliding_window == 7 and nested.image_token_id == 5
    assert nested.text_config.num_hidden_layers == Gemma3Config().text_config.num_hidden_layers

    with LLM(path, dtype="float32", max_model_len=100, skip_tokenizer_init=True,
             hf_overrides={"max_position_embeddings": 128}) as llm:
        out = llm.generate([{"prompt_token_ids": list(range(3, 93))}],
                           SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
