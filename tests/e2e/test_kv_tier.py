"""The KV offload tier (--kv-offload-size, --kv-offload-path) on the tiny random Llama in
float32: a KV cache of 16 blocks of 4 tokens, so one 40-token prompt's blocks are
evicted by the next. An evicted prefix comes back from the tier with the tokens a
recompute gives, and counted as cached; a corrupted record, or one written under other
weights, is refused and recomputed; a weight update empties the tier; a full tier
evicts and fails nothing; preempted requests resume from it with the same tokens."""

from __future__ import annotations

import os
import random

import pytest
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer
from weight_variants import make_variant

from loom import LLM, SamplingParams

BLOCK, NUM_BLOCKS = 4, 16
BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # 2 layers x K,V x 4 tokens x 2 heads x 16 x fp32
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=64, block_size=BLOCK, enable_warm_up=False,
              num_gpu_blocks_override=NUM_BLOCKS)
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Each prompt's greedy tokens, computed whole (no prefix cache)."""
    with LLM(tiny_llama, enable_prefix_caching=False, **ENGINE) as llm:
        return generate(llm, PROMPTS)


def generate(llm: LLM, prompts, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in generate_outputs(llm, prompts, params)]


def generate_outputs(llm: LLM, prompts, params=PARAMS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tier_engine(path: str, directory, size: int = 1 << 20, **kwargs) -> LLM:
    return LLM(path, kv_offload_size=size, kv_offload_path=str(directory), **ENGINE, **kwargs)


def tier_of(llm: LLM):
    return llm.engine.engine_core.scheduler.kv_cache.tier


def one_by_one(llm: LLM, prompts) -> list:
    """Each prompt alone, in turn: each evicts the blocks of the one before."""
    return [generate_outputs(llm, [prompt])[0] for prompt in prompts]


def test_an_evicted_prefix_is_served_from_the_tier(tiny_llama, reference, tmp_path):
    with tier_engine(tiny_llama, tmp_path) as llm:
        assert len(os.listdir(tmp_path)) == 1  # this rank's file
        first = one_by_one(llm, PROMPTS)
        assert [o.num_cached_tokens for o in first] == [0] * 4
        again = one_by_one(llm, PROMPTS)
        assert [o.outputs[0].token_ids for o in again] == reference
        # 9 full blocks of each 40-token prompt (its last token is computed) from the tier
        assert [o.num_cached_tokens for o in again] == [36] * 4
        assert tier_of(llm).stats.loads == 4 * 9 and tier_of(llm).stats.load_failures == 0
        # A second turn: the first turn's prompt and answer, and more, after others ran.
        turn = PROMPTS[0] + again[0].outputs[0].token_ids + [17, 18]
        with LLM(tiny_llama, enable_prefix_caching=False, **ENGINE) as recompute:
            expected = generate(recompute, [turn])
        one_by_one(llm, PROMPTS[1:3])
        second = generate_outputs(llm, [turn])[0]
        assert second.outputs[0].token_ids == expected[0] and second.num_cached_tokens >= 36
    assert os.listdir(tmp_path) == []  # removed at shutdown


def test_a_refused_record_is_recomputed(tiny_llama, reference, tmp_path):
    """Every record's payload flipped on disk: the checksum refuses each load, the hit is
    0 and the tokens are a recompute's. Then records written under an earlier weights
    epoch (the rank's invalidate) are refused the same way."""
    with tier_engine(tiny_llama, tmp_path) as llm:
        tier = tier_of(llm)
        one_by_one(llm, PROMPTS)
        (name,) = os.listdir(tmp_path)
        headers = -(-tier.num_slots * 64 // 4096) * 4096
        with open(tmp_path / name, "r+b") as file:
            data = bytearray(file.read())
            data[headers:] = bytes(b ^ 0xFF for b in data[headers:])
            file.seek(0)
            file.write(data)
        outputs = one_by_one(llm, PROMPTS[:1])
        assert outputs[0].outputs[0].token_ids == reference[0]
        # its 9 blocks loaded in one step, each refused
        assert outputs[0].num_cached_tokens == 0 and tier.stats.load_failures == 9
        one_by_one(llm, PROMPTS[1:])  # the first prompt's blocks written again
        failures = tier.stats.load_failures
        llm.engine.engine_core.executor.worker.kv_tier.invalidate()
        outputs = one_by_one(llm, PROMPTS[:1])
        assert outputs[0].outputs[0].token_ids == reference[0]
        assert outputs[0].num_cached_tokens == 0 and tier.stats.load_failures == failures + 9


def test_a_weight_update_empties_the_tier(tiny_llama, tmp_path):
    """After an update to other weights the tier holds nothing; the tokens are those of a
    fresh engine on the new weights (a stale block would give the old ones' K/V); a
    sleep and wake-up empty it too."""
    other = make_variant(tiny_llama, str(tmp_path / "other"), 4242)
    with LLM(other, enable_prefix_caching=False, **ENGINE) as fresh:
        expected = generate(fresh, PROMPTS[:2])
    directory = tmp_path / "tier"
    directory.mkdir()
    with tier_engine(tiny_llama, directory) as llm:
        tier = tier_of(llm)
        one_by_one(llm, PROMPTS)
        assert len(tier) > 0
        llm.update_weights(other)
        assert len(tier) == 0
        loads = tier.stats.loads
        outputs = one_by_one(llm, PROMPTS[:2])
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert [o.num_cached_tokens for o in outputs] == [0, 0] and tier.stats.loads == loads
        one_by_one(llm, PROMPTS[2:])
        assert len(tier) > 0
        llm.sleep(1)
        llm.wake_up()
        assert len(tier) == 0


def test_a_full_tier_evicts_and_fails_nothing(tiny_llama, reference, tmp_path):
    """Three slots for the blocks of four prompts: the least recently used go, every
    request gets a recompute's tokens, and those whose blocks are still there load them."""
    with tier_engine(tiny_llama, tmp_path, size=3 * (BYTES_PER_BLOCK + 64)) as llm:
        tier = tier_of(llm)
        assert tier.num_slots == 3
        for _ in range(2):
            outputs = one_by_one(llm, PROMPTS)
            assert [o.outputs[0].token_ids for o in outputs] == reference
        assert len(tier) == 3 and tier.stats.evictions > 0


def test_preempted_requests_resume_from_the_tier(tiny_llama, tmp_path):
    """Three requests of 12 + 36 tokens in 16 blocks: the newest are preempted while
    decoding; their full blocks go to the tier as the pool reuses them and come back
    when they resume. The tokens are those of an engine that never preempts."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(12)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    with LLM(tiny_llama, **(ENGINE | dict(num_gpu_blocks_override=64, max_model_len=64))
             ) as roomy:
        expected = generate(roomy, prompts, params)
        assert roomy.engine.engine_core.scheduler.num_preemptions == 0
    with tier_engine(tiny_llama, tmp_path) as llm:
        assert generate(llm, prompts, params) == expected
        assert llm.engine.engine_core.scheduler.num_preemptions > 0
        assert tier_of(llm).stats.loads > 0 and tier_of(llm).stats.load_failures == 0


def test_a_hybrid_kv_cache_comes_back_whole(tmp_path):
    """Gemma 3 (local layers with a window of 12, one global): each KV cache group's
    blocks are saved and loaded under their own keys; the tokens are a recompute's."""
    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    make_tiny_tokenizer(path)
    engine = ENGINE | dict(num_gpu_blocks_override=48)  # three groups' blocks a sequence
    with LLM(path, enable_prefix_caching=False, **engine) as llm:
        expected = generate(llm, PROMPTS)
    with LLM(path, kv_offload_size=1 << 20, kv_offload_path=str(tmp_path), **engine) as llm:
        assert llm.engine.engine_core.scheduler.kv_cache.num_groups > 1
        one_by_one(llm, PROMPTS)
        again = one_by_one(llm, PROMPTS)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert all(o.num_cached_tokens > 0 for o in again) and tier_of(llm).stats.loads > 0


def test_an_fp8_cache_comes_back_from_the_tier(tiny_llama, tmp_path):
    """--kv-cache-dtype fp8_e4m3: records hold the rows as the cache does, scales inside,
    and an evicted prefix comes back with the tokens of a recompute over an fp8 cache.
    The records' fingerprint names the dtype: int8 rows have the same shape and bytes."""
    fingerprints = {}
    for cache_dtype in ("fp8_e4m3", "int8"):
        with LLM(tiny_llama, enable_prefix_caching=False, kv_cache_dtype=cache_dtype,
                 **ENGINE) as llm:
            expected = generate(llm, PROMPTS)
        with tier_engine(tiny_llama, tmp_path, kv_cache_dtype=cache_dtype) as llm:
            worker = llm.engine.engine_core.executor.worker
            assert str(worker.model_runner.kv_cache_storage.dtype) == {
                "fp8_e4m3": "torch.float8_e4m3fn", "int8": "torch.int8"}[cache_dtype]
            fingerprints[cache_dtype] = worker.kv_tier.fingerprint
            one_by_one(llm, PROMPTS)
            again = one_by_one(llm, PROMPTS)
            assert [o.outputs[0].token_ids for o in again] == expected
            assert [o.num_cached_tokens for o in again] == [36] * 4
            assert tier_of(llm).stats.load_failures == 0
    assert fingerprints["fp8_e4m3"] != fingerprints["int8"]


def test_tensor_parallel_ranks_agree_on_a_refusal(tiny_llama, reference, tmp_path):
    """Two ranks, each a file of its own heads: an evicted prefix comes back on both;
    then rank 1's records are corrupted and rank 0's are not, and both take the miss
    (the ranks' refusals are summed): the tokens are a recompute's."""
    with tier_engine(tiny_llama, tmp_path, tensor_parallel_size=2) as llm:
        tier = tier_of(llm)
        one_by_one(llm, PROMPTS[:2])
        again = one_by_one(llm, PROMPTS[:2])
        assert [o.outputs[0].token_ids for o in again] == reference[:2]
        assert [o.num_cached_tokens for o in again] == [36, 36]
        (rank1,) = [name for name in os.listdir(tmp_path) if "-kvtier-1-" in name]
        headers = -(-tier.num_slots * 64 // 4096) * 4096
        with open(tmp_path / rank1, "r+b") as file:
            file.seek(headers)
            data = file.read()
            file.seek(headers)
            file.write(bytes(b ^ 0xFF for b in data))
        failures = tier.stats.load_failures
        outputs = one_by_one(llm, PROMPTS[:1])
        assert outputs[0].outputs[0].token_ids == reference[0]
        # what the pool still held is a hit; each block that was to come from the tier,
        # refused
        refused = tier.stats.load_failures - failures
        assert refused > 0 and outputs[0].num_cached_tokens + 4 * refused == 36
    assert os.listdir(tmp_path) == []
