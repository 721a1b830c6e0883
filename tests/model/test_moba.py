"""MoBA (mixture of block attention, --moba-attention-config): loom's PyTorch path and its
CPU kernel equal a plain dense reference of the algorithm over unpaged K/V, step after
step (prefill chunks, decodes, several requests in a step, GQA, chunks crossing MoBA
blocks and the minimum length); the config is checked in one line; an LLM with MoBA
gives full attention's greedy tokens below the minimum and a model-level reference's
above it."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from loom.config import MobaAttentionConfig
from loom.kernels import native_ops
from loom.model.attention.cpu_backend import CpuAttentionBackend
from loom.model.attention.kv_layout import is_quantized_kv
from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.moba import MobaAttention
from loom.model.attention.torch_backend import (TorchAttentionBackend, dequantize_kv_rows,
                                                quantize_kv_rows)


def moba_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                   block: int, topk: int, min_len: int, scale: float) -> torch.Tensor:
    """MoBA as the paper states it, one query and head at a time, in float64: ``q``
    (N, H, D) at ``positions`` of a sequence whose keys/values are ``k``/``v`` (S, Hkv, D).
    A query at p with p + 1 >= min_len sees its own block's keys up to p and the
    topk - 1 earlier blocks whose mean key scores highest (the earlier block among
    equals); below min_len, keys 0..p."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    complete = k.shape[0] // block
    means = k[:complete * block].reshape(complete, block, *k.shape[1:]).mean(1)  # (M, Hkv, D)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, p in enumerate(positions):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            if p + 1 < min_len:
                keys = list(range(p + 1))
            else:
                own = p // block
                gates = (means[:own, kv] @ q[row, h]).tolist()  # block m: q . mean key
                chosen = sorted(range(own), key=lambda m: (-gates[m], m))[:topk - 1]
                keys = [m * block + i for m in sorted(chosen) for i in range(block)]
                keys += list(range(own * block, p + 1))
            scores = (k[keys, kv] @ q[row, h]) * scale
            out[row, h] = scores.softmax(0) @ v[keys, kv]
    return out


class Requests:
    """Whole random sequences of Q/K/V per request, run through a paged cache in steps,
    as the model runner would: shuffled blocks, slot mappings, block tables."""

    def __init__(self, lengths, heads, kv_heads, head_dim, block_size, dtype, cache_dtype,
                 num_blocks=160, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lengths]
        self.k = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables = [[] for _ in lengths]
        self.done = [0] * len(lengths)
        shape = TorchAttentionBackend(heads, kv_heads, head_dim, 1.0).kv_cache_shape(
            num_blocks, block_size, quantized=is_quantized_kv(cache_dtype))
        # unwritten slots hold NaN: attention must never read one
        self.kv_cache = (torch.zeros(shape, dtype=cache_dtype) if is_quantized_kv(cache_dtype)
                         else torch.full(shape, float("nan"), dtype=cache_dtype))
        self.cache_dtype = cache_dtype

    def step(self, work: list[tuple[int, int]]):
        """(query, key, value, metadata, [(request, positions)]) for ``work``: (request,
        new tokens) pairs."""
        slots, starts, lens, spans = [], [0], [], []
        for i, n in work:
            first = self.done[i]
            table = self.tables[i]
            while len(table) * self.block_size < first + n:
                table.append(self.free.pop())
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(first, first + n)]
            starts.append(starts[-1] + n)
            lens.append(first + n)
            spans.append((i, list(range(first, first + n))))
            self.done[i] = first + n
        width = max(len(self.tables[i]) for i, _ in work)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=torch.tensor([self.tables[i] + [0] * (width - len(self.tables[i]))
                                      for i, _ in work], dtype=torch.int32),
            query_start_loc_cpu=starts, seq_lens_cpu=lens,
            max_query_len=max(n for _, n in work), max_seq_len=max(lens),
            block_size=self.block_size)
        pick = lambda xs: torch.cat([xs[i][pos[0]:pos[-1] + 1] for i, pos in spans])  # noqa: E731
        return pick(self.q), pick(self.k), pick(self.v), metadata, spans

    def cached(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K or V as the cache gives them back to a model in ``dtype``."""
        if is_quantized_kv(self.cache_dtype):
            return dequantize_kv_rows(quantize_kv_rows(x, self.cache_dtype), dtype)
        return x.to(self.cache_dtype).to(dtype)


# request 0: prefill in chunks of 21 and 30 (crossing the minimum and MoBA blocks), then
# decodes; request 1: 9 tokens, then decodes from below the minimum to above it; request
# 2: one 44-token chunk that starts below the minimum and ends above it; request 3 joins
# late with a chunk of 1 and decodes (a mixed step of chunks and decodes throughout).
SCHEDULE = ([[(0, 21), (1, 9)], [(0, 30), (1, 1), (2, 44)]]
            + [[(0, 1), (1, 1), (2, 1)]] * 6 + [[(0, 1), (1, 1), (3, 1), (2, 3)]]
            + [[(0, 1), (1, 1), (3, 1)]] * 12)
LENGTHS = [21 + 30 + 19, 9 + 20, 44 + 6 + 3, 13]
BLOCK, TOPK, MIN_LEN = 8, 3, 20  # MoBA blocks of two cache blocks of 4


def run_schedule(backend_cls, dtype, cache_dtype, heads=4, kv_heads=2, head_dim=32,
                 topk=TOPK, min_len=MIN_LEN):
    """Every step's output and the reference's, over SCHEDULE."""
    backend = backend_cls(heads, kv_heads, head_dim, head_dim ** -0.5)
    moba = MobaAttention(MobaAttentionConfig(BLOCK, topk, min_len), backend)
    reqs = Requests(LENGTHS, heads, kv_heads, head_dim, 4, dtype, cache_dtype)
    got, want = [], []
    for work in SCHEDULE:
        q, k, v, metadata, spans = reqs.step(work)
        with torch.inference_mode():
            got.append(moba(q, k, v, reqs.kv_cache, metadata))
        want.append(torch.cat([
            moba_reference(reqs.q[i][pos[0]:pos[-1] + 1],
                           reqs.cached(reqs.k[i][:pos[-1] + 1], dtype),
                           reqs.cached(reqs.v[i][:pos[-1] + 1], dtype),
                           pos, BLOCK, topk, min_len, head_dim ** -0.5)
            for i, pos in spans]))
    return got, want


needs_kernels = pytest.mark.skipif(native_ops() is None, reason="loom's CPU kernels did not build")
BACKENDS = [TorchAttentionBackend, pytest.param(CpuAttentionBackend, marks=needs_kernels)]


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (8, 1)])
def test_moba_equals_the_dense_reference(backend_cls, heads, kv_heads):
    """float32, every step of SCHEDULE within 1e-5 of the reference: the PyTorch path
    and the CPU kernel, GQA groups of 2 and 8 and plain multi-head."""
    got, want = run_schedule(backend_cls, torch.float32, torch.float32, heads, kv_heads)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.int8),
                                               (torch.float32, torch.float8_e4m3fn),
                                               (torch.float32, torch.float8_e5m2),
                                               (torch.float32, torch.bfloat16)])
def test_moba_in_other_dtypes(backend_cls, dtype, cache_dtype):
    """A bfloat16 model, an int8 or fp8 cache and a bfloat16 cache under float32: the K/V the
    cache gives back, attended as the reference does (bf16 outputs to its rounding)."""
    got, want = run_schedule(backend_cls, dtype, cache_dtype)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=0, msg=f"step {step}")


def test_the_reference_is_sparse_and_full_below_the_minimum():
    """The reference itself: MoBA differs from full attention above the minimum, equals it
    below, and with topk covering every block equals full attention everywhere."""
    torch.manual_seed(0)
    q, k, v = torch.randn(40, 2, 16), torch.randn(40, 1, 16), torch.randn(40, 1, 16)
    positions = list(range(40))
    full = moba_reference(q, k, v, positions, BLOCK, 99, 0, 0.25)
    sparse = moba_reference(q, k, v, positions, BLOCK, 2, 20, 0.25)
    torch.testing.assert_close(sparse[:19], full[:19], atol=1e-12, rtol=0)
    assert (sparse[19:] - full[19:]).abs().amax(-1).gt(1e-3).all()


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_moba_is_not_full_attention(backend_cls):
    """Loom's output moves with the choice: topk 1 (own block only) and topk covering
    every block give other outputs above the minimum, the same below."""
    narrow, _ = run_schedule(backend_cls, torch.float32, torch.float32, topk=1)
    wide, _ = run_schedule(backend_cls, torch.float32, torch.float32, topk=99)
    mid, _ = run_schedule(backend_cls, torch.float32, torch.float32)
    last = len(SCHEDULE) - 1  # request 0 at position 69: 8 earlier blocks, 2 chosen
    for other in (narrow, wide):
        assert (mid[last][0] - other[last][0]).abs().max() > 1e-3
    torch.testing.assert_close(mid[0][21:], wide[0][21:], atol=1e-6, rtol=0)  # request 1


# ---------------------------------------------------------------- the config


BAD_CONFIGS = [
    ('{"moba_block_size": 64}', "needs moba_topk"),
    ('{"moba_block_size": 0, "moba_topk": 2}', "moba_block_size must be an integer >= 1"),
    ('{"moba_block_size": 64, "moba_topk": 2.5}', "moba_topk must be an integer >= 1"),
    ('{"moba_block_size": 64, "moba_topk": 2, "moba_min_seq_len": -1}',
     "moba_min_seq_len must be an integer >= 0"),
    ('{"moba_block_size": 24, "moba_topk": 2}', "multiple of --block-size 16"),
    ('{"moba_block_size": 64, "moba_topk": 2, "moba_encoder_top_k_left": 2}',
     "is FastDeploy's; loom takes moba_topk"),
    ('{"moba_block_size": 64, "moba_topk": 2, "topk": 2}', "unknown keys ['topk']"),
    ("[64, 2]", "must be a JSON object"),
]


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory) -> str:
    from tokenizer_fixtures import make_tiny_tokenizer

    from .checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("moba-llama"))
    make_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("value,fragment", BAD_CONFIGS)
def test_a_bad_config_names_the_fault(tiny_llama_path, value, fragment):
    from loom.engine_args import EngineArgs

    with pytest.raises(ValueError, match="moba_attention_config") as error:
        EngineArgs(model=tiny_llama_path, moba_attention_config=value).create_engine_config()
    assert fragment in str(error.value)
    config = EngineArgs(model=tiny_llama_path, moba_attention_config={
        "moba_block_size": 32, "moba_topk": 3}).create_engine_config()
    assert config.moba_attention == MobaAttentionConfig(32, 3, 0)


@pytest.mark.parametrize("value", ['{"moba_block_size": 64', '{"moba_block_size": 24, '
                                                             '"moba_topk": 2}'])
def test_a_bad_config_is_one_line_at_start_up(tiny_llama_path, value):
    """`loom generate --moba-attention-config BAD`: exit 2, one error line naming it
    (bad JSON, found by the flag's parser; a bad value, by the config)."""
    run = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--model",
                          tiny_llama_path, "--prompt", "hi", "--max-tokens", "1",
                          "--moba-attention-config", value],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "moba" in errors[0], run.stderr


# ---------------------------------------------------------------- end to end

E2E_MOBA = {"moba_block_size": 16, "moba_topk": 2, "moba_min_seq_len": 48}
E2E_TOKENS = 6


def _hf_moba_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """transformers' attention interface over E2E_MOBA: the model-level reference."""
    assert query.shape[0] == 1, "one sequence at a time"
    positions = list(range(query.shape[2]))
    out = moba_reference(query[0].transpose(0, 1), key[0].transpose(0, 1),
                         value[0].transpose(0, 1), positions, E2E_MOBA["moba_block_size"],
                         E2E_MOBA["moba_topk"], E2E_MOBA["moba_min_seq_len"], scaling)
    return out.to(query.dtype)[None], None


@pytest.fixture(scope="module")
def e2e_case(tiny_llama_path):
    """A tiny Llama, three prompts (20 tokens: below the minimum throughout; 70 and 100:
    above it), and the greedy tokens of transformers' model with full attention and with
    the reference MoBA as its attention."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    path = tiny_llama_path
    AttentionInterface.register("loom_test_moba", _hf_moba_attention)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (20, 70, 100)]
    expected = {}
    for name in ("eager", "loom_test_moba"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation=name).eval()
        expected[name] = []
        with torch.no_grad():
            for prompt in prompts:
                ids = list(prompt)
                for _ in range(E2E_TOKENS):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                expected[name].append(ids[len(prompt):])
    # the reference is not vacuous: MoBA changes some greedy token above the minimum
    assert expected["eager"][0] == expected["loom_test_moba"][0]
    assert expected["eager"][1:] != expected["loom_test_moba"][1:]
    return path, prompts, expected


@pytest.mark.parametrize("attention_backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
def test_llm_with_moba_equals_the_reference_model(e2e_case, attention_backend):
    """LLM(moba_attention_config=...) in one batch, prefills chunked by a 32-token budget
    (chunks that cross the minimum and MoBA blocks): below the minimum full attention's
    greedy tokens, above it the reference model's."""
    from loom import LLM, SamplingParams

    path, prompts, expected = e2e_case
    llm = LLM(path, dtype="float32", max_model_len=256, seed=0, max_num_batched_tokens=32,
              attention_backend=attention_backend, moba_attention_config=E2E_MOBA)
    params = SamplingParams(temperature=0.0, max_tokens=E2E_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(out.outputs[0].token_ids) for out in outputs]
    assert got[0] == expected["eager"][0]
    assert got == expected["loom_test_moba"]


@needs_kernels
def test_a_replayed_forward_chooses_anew_each_step(monkeypatch):
    """An attention layer with MoBA recorded at its first decode step, below the minimum
    (kernel_replay.py), and replayed for every later one, past the minimum and across
    MoBA blocks: each step equals the reference, the choices made at replay time."""
    from loom.model import kernel_replay
    from loom.model.layers.attention import Attention
    from loom.model.attention.metadata import set_forward_context

    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)
    heads, kv_heads, head_dim = 4, 2, 32
    layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, 0, backend="cpu")
    layer.moba = MobaAttention(MobaAttentionConfig(BLOCK, TOPK, MIN_LEN), layer.impl)
    reqs = Requests([60], heads, kv_heads, head_dim, 4, torch.float32, torch.float32)
    layer.kv_cache = reqs.kv_cache
    replay = kernel_replay.KernelReplay(layer.forward, layer)
    with torch.inference_mode():
        q, k, v, metadata, _ = reqs.step([(0, 12)])  # a prefill, eager: another shape
        with set_forward_context(metadata):
            layer(q, k, v)
        for _ in range(48):
            q, k, v, metadata, [(_, positions)] = reqs.step([(0, 1)])
            with set_forward_context(metadata):
                out = replay(q.flatten(1), k.flatten(1), v.flatten(1))
            want = moba_reference(q, reqs.k[0][:positions[-1] + 1], reqs.v[0][:positions[-1] + 1],
                                  positions, BLOCK, TOPK, MIN_LEN, head_dim ** -0.5)
            torch.testing.assert_close(out.view(1, heads, head_dim).double(), want, atol=1e-5,
                                       rtol=0, msg=f"position {positions[0]}")
    assert replay.refusal is None and replay.stats.replayed == 47, replay.stats
