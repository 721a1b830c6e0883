"""Expert parallel across data-parallel replicas with quantized experts: ``--quantization
wint8`` / ``wint4`` (each expert quantized at load, a ``QuantizedExpert``) and a GGUF
file's experts kept in the file's formats (Q4_0, Q8_0 and the K-quant Q6_K), sent to and
run on their rank by all-to-all exactly as full-precision ones.

Per format, ``DPAsyncLLM`` with DP=2 x EP=2 (TP=1) answers with one rank's greedy tokens
(every expert, the same quantized weights, float32): requests one at a time (one replica
works, the other takes dummy steps) and all at once; each rank holds half of every
layer's experts, in the expected format, and sent rows to the other rank. With EPLB
(wint8, the router biased toward two experts) the spare slots take copies of them, moved
as the held quantized bytes, and the tokens stay one rank's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from dp_greedy import one_then_all
from checkpoints import bias_router, make_tiny_checkpoint

from loom import LLM, SamplingParams
from loom.engine_args import EngineArgs

MAX_TOKENS = 6
GROUP = 32  # divides every input width of the tiny checkpoints (64, 128, 256)
PROMPTS = [[5, 6, 7], list(range(3, 20)), list(range(40, 90)), [9] * 30]


def _q6_k_block_bytes(rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K blocks (256 values, 210 bytes) with small finite scales."""
    raw = rng.integers(0, 256, (rows, blocks, 210), dtype=np.uint8)
    raw[..., 192:208] = rng.integers(-8, 9, (rows, blocks, 16), dtype=np.int8).view(np.uint8)
    scale = (np.abs(rng.standard_normal((rows, blocks))) * 2e-3 + 1e-3).astype(np.float16)
    raw[..., 208:210] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * 210)


def _write_gguf(tmp_path) -> str:
    """A Qwen3-MoE GGUF file whose experts are gate Q4_0, up Q8_0 (quantized from the
    checkpoint) and down Q6_K (random blocks: gguf's writer has no K-quant quantizer)."""
    import gguf
    from model.test_moe_gguf import copy_metadata, write_gguf

    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "gguf-src",
                                      moe_intermediate_size=256)
    reader = gguf.GGUFReader(write_gguf(checkpoint, str(tmp_path / "plain.gguf"), "qwen3_moe"))
    path = str(tmp_path / "experts.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    copy_metadata(reader, writer)
    rng = np.random.default_rng(3)
    Q = gguf.GGMLQuantizationType
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if ".ffn_gate_exps." in tensor.name or ".ffn_up_exps." in tensor.name:
            qtype = Q.Q4_0 if ".ffn_gate_exps." in tensor.name else Q.Q8_0
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        elif ".ffn_down_exps." in tensor.name:  # (experts, hidden, 256)
            experts, hidden, inter = data.shape
            raw = _q6_k_block_bytes(experts * hidden, inter // 256, rng)
            writer.add_tensor(tensor.name, raw.reshape(experts, hidden, -1), raw_dtype=Q.Q6_K)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


async def _dp_greedy(config) -> tuple[list, list, list, list, list]:
    from loom.dp_async_llm import DPAsyncLLM

    llm = DPAsyncLLM(config, log_requests=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    await llm.start()
    try:
        one_at_a_time, all_at_once, replicas = await one_then_all(llm, PROMPTS, params)
        formats = await llm.control("collective_rpc", method="moe_expert_formats")
        sent = await llm.control("collective_rpc", method="collective_bytes")
        return one_at_a_time, list(all_at_once), replicas, formats, sent
    finally:
        await llm.shutdown()


@pytest.mark.parametrize("case", ["wint8", "wint4", "gguf"])
def test_dp2_ep2_quantized_experts_match_one_rank(tmp_path, case):
    from tokenizer_fixtures import make_tiny_tokenizer

    if case == "gguf":
        path, quantization, family = _write_gguf(tmp_path), "auto", "qwen3_moe"
        held = ["Q4_0+Q8_0", "Q6_K"]  # gate|up fused into w13 (two formats), down
    else:
        # wint4 on ERNIE 4.5 MoE (shared experts, a dense first layer, a correction bias)
        family = "qwen3_moe" if case == "wint8" else "ernie4_5_moe"
        path = make_tiny_checkpoint(family, tmp_path / family)
        make_tiny_tokenizer(path)
        quantization, held = case, [case, case]
    engine = dict(dtype="float32", max_model_len=128, quantization=quantization,
                  quantization_group_size=GROUP, skip_tokenizer_init=case == "gguf")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, enable_warm_up=False, **engine) as llm:  # one rank, every expert
        expected = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    config = EngineArgs(model=path, data_parallel_size=2, enable_expert_parallel=True,
                        watchdog_timeout_s=15.0, **engine).create_engine_config()
    one_at_a_time, all_at_once, replicas, formats, sent = asyncio.run(_dp_greedy(config))
    assert one_at_a_time == expected
    assert all_at_once == expected
    assert set(replicas) == {0, 1}, replicas  # each replica alone, the other in dummy steps
    ranks = [rank for replica in formats for rank in replica]
    assert len(ranks) == 2
    for layers in ranks:  # every MoE layer: 4 of the 8 experts here, quantized as asked
        assert layers and all(len(experts) == 4 for experts in layers), layers
        assert {tuple(pair) for experts in layers for pair in experts} == {tuple(held)}, layers
    assert all(rank["all_to_all_remote"] > 0 for replica in sent for rank in replica), sent


def test_eplb_moves_quantized_experts_and_keeps_one_ranks_tokens(tmp_path):
    """wint8 experts, the router biased toward experts 1 and 2: EPLB (2 redundant slots,
    a rearrangement every 4 steps) gives both spare slots to them on every rank alike,
    moving the quantized bytes, and the tokens equal one rank's without EPLB."""
    from tokenizer_fixtures import make_tiny_tokenizer

    path = bias_router(make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe"))
    make_tiny_tokenizer(path)
    engine = dict(dtype="float32", max_model_len=128, quantization="wint8")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, enable_warm_up=False, **engine) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    async def run_all(config):
        from loom.dp_async_llm import DPAsyncLLM

        llm = DPAsyncLLM(config, log_requests=False)
        await llm.start()
        try:
            async def run(request_id, prompt):
                async for output in llm.add_request(request_id, None, prompt, params,
                                                    stream=False):
                    last = output
                return list(last.outputs[0].token_ids)

            first = await asyncio.gather(*(run(f"a{i}", p) for i, p in enumerate(PROMPTS)))
            second = await asyncio.gather(*(run(f"b{i}", p) for i, p in enumerate(PROMPTS)))
            return list(first), list(second), await llm.control(
                "collective_rpc", method="eplb_placement")
        finally:
            await llm.shutdown()

    config = EngineArgs(model=path, data_parallel_size=2, enable_expert_parallel=True,
                        enable_eplb=True, num_redundant_experts=2, eplb_window_size=4,
                        watchdog_timeout_s=15.0, **engine).create_engine_config()
    first, second, answers = asyncio.run(run_all(config))
    assert first == expected and second == expected  # (the second after the moves)
    ranks = [rank for replica in answers for rank in replica]
    assert len(ranks) == 2 and all(rank["rearranged"] > 0 for rank in ranks), ranks
    assert ranks[0]["placement"] == ranks[1]["placement"]
    for placement in ranks[0]["placement"]:  # at first slots 8, 9 copy experts 0 and 1
        assert placement.count(1) + placement.count(2) == 4, placement
