"""The native kernels' AVX-512 and generic paths give the same results.

A build on a CPU with AVX512-BF16 takes the AVX-512 path of the kernels that have one
(bf16 SiLU*mul; bf16 paged attention at head_dim 32, 64, 128); every other CPU runs the
generic C++ path. ``set_isa`` (for tests only) makes one build run either, so both are
checked here on every machine that has AVX512-BF16. The other kernels have one path;
they are run under both settings too, so that a second path added later is held to the
same bits. bf16_linear has its AVX512-BF16 path only: nothing to compare.
"""

from __future__ import annotations

import pytest
import torch

from loom.envs import settings
from loom.kernels import native_ops
from loom.model.layers.rotary import RotaryEmbedding, _default_inv_freq

from .test_kernels import _paged_case


@pytest.fixture(scope="module")
def ops():
    module = native_ops()
    assert module is not None, "the native CPU kernels failed to build (see the log)"
    return module


@pytest.fixture
def both(ops):
    """``both(fn)`` -> ``{"generic": fn(), "avx512": fn()}``, each run under that ISA;
    skips where the build has no AVX-512 path, and restores the ISA afterwards."""
    if "avx512" not in ops.isas():
        pytest.skip("this CPU lacks AVX512_BF16: the build has the generic path only")
    previous = ops.isa()

    def run(fn):
        results = {}
        for isa in ("generic", "avx512"):
            ops.set_isa(isa)
            results[isa] = fn()
        return results

    yield run
    ops.set_isa(previous)


def test_set_isa_switches_and_names_what_the_build_has(ops):
    assert ops.isas()[0] == "generic" and ops.isa() in ops.isas()
    previous = ops.isa()
    try:
        assert ops.set_isa("generic") == previous
        assert ops.isa() == "generic"
        with pytest.raises(RuntimeError, match="'sse' is not an instruction set of this build"):
            ops.set_isa("sse")
        assert ops.isa() == "generic"
        if "avx512" in ops.isas():
            assert ops.set_isa("avx512") == "generic" and ops.isa() == "avx512"
        else:
            with pytest.raises(RuntimeError, match="it has generic"):
                ops.set_isa("avx512")
    finally:
        ops.set_isa(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_paths_equal_bit_for_bit(ops, both, dtype):
    """The AVX-512 row is the generic row's operations on 16 lanes (same exp
    polynomial, division, roundings), so the bits are the same; it differs only where a
    result is a float32 denormal (vcvtneps2bf16 flushes them), which these avoid."""
    torch.manual_seed(0)
    # widths: whole 16-lane blocks, a scalar tail, narrower than one block
    for rows, width in [(5, 1536), (3, 37), (2, 7)]:
        x = torch.randn(rows, 2 * width, dtype=dtype) * 4
        x[0, :6] = torch.tensor([-200.0, 90.0, 0.0, -0.0, 1e-3, -88.0])  # exp under/overflow
        out = both(lambda: ops.silu_and_mul(x))
        assert torch.equal(out["generic"], out["avx512"]), (rows, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_path_kernels_equal_under_both(ops, both, dtype):
    """RMSNorm, fused add + RMSNorm, rotary and the KV write have one path each."""
    torch.manual_seed(1)
    x, w = torch.randn(7, 576, dtype=dtype) * 3, torch.randn(576, dtype=dtype)
    out = both(lambda: ops.rms_norm(x, w, 1e-5))
    assert torch.equal(out["generic"], out["avx512"])

    residual = torch.randn(7, 576, dtype=dtype)

    def fused():
        x_, residual_ = x.clone(), residual.clone()
        ops.fused_add_rms_norm(x_, residual_, w, 1e-6)
        return x_, residual_

    out = both(fused)
    assert all(torch.equal(a, b) for a, b in zip(out["generic"], out["avx512"]))

    rope = RotaryEmbedding(64, 64, 4096, _default_inv_freq(10000.0, 64))
    qk = torch.randn(6, 6, 64, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 4095, 17, 300])

    def rotary():
        rotated = qk.clone()
        ops.rotary_embedding(rotated, positions, rope.cos_sin_cache)
        return rotated

    out = both(rotary)
    assert torch.equal(out["generic"], out["avx512"])

    cache, metadata, _, k, v = _paged_case([20, 7], [3, 7], 4, 2, 64, 16, dtype)

    def write():
        written = cache.clone()
        ops.write_kv_cache(k, v, written, metadata.slot_mapping)
        return written

    out = both(write)
    assert torch.equal(out["generic"], out["avx512"])


# decodes (1 new token), a verify (4), a chunk over a cached prefix (50), a prefill from
# scratch (40: tiles of 16, 16, 8) and a tile boundary (17), contexts crossing blocks
CONTEXT_LENS = [1, 37, 300, 50 + 61, 40, 17 + 3, 129]
QUERY_LENS = [1, 1, 4, 50, 40, 17, 1]


def _attention(ops, both, dtype, heads, kv_heads, head_dim, block_size):
    cache, metadata, q, k, v = _paged_case(CONTEXT_LENS, QUERY_LENS, heads, kv_heads,
                                           head_dim, block_size, dtype, seed=head_dim)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)

    def attend():
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                            metadata.query_start_loc, head_dim ** -0.5, 1 << 30)
        return out

    return both(attend), (cache, metadata, q)


def _reference(cache, metadata, q, head_dim) -> torch.Tensor:
    """Causal attention in float64 over the same bf16 inputs: (T, H, D)."""
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = metadata.query_start_loc_cpu
    for b, context in enumerate(metadata.seq_lens_cpu):
        slots = torch.tensor([int(metadata.block_table[b, p // block_size]) * block_size
                              + p % block_size for p in range(context)])
        keys = cache[0].flatten(1, 2)[:, slots].double()    # (Hkv, context, D)
        values = cache[1].flatten(1, 2)[:, slots].double()
        q_len = starts[b + 1] - starts[b]
        query = q[starts[b]:starts[b + 1]].double().transpose(0, 1)  # (H, q_len, D)
        scores = query @ keys.repeat_interleave(group, 0).transpose(1, 2) * head_dim ** -0.5
        visible = torch.arange(context)[None, :] <= (context - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[b]:starts[b + 1]] = (scores.softmax(-1) @ values.repeat_interleave(group, 0)
                                        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2-135M
    (4, 4, 32, 4),    # no GQA, tiny blocks
    (8, 2, 128, 32),  # wider heads
])
def test_paged_attention_paths_agree_bf16(ops, both, heads, kv_heads, head_dim, block_size):
    """Decode items and prefill tiles, on the head sizes the AVX-512 path takes. The
    paths round differently, so the bits differ: the AVX-512 path sums q.k in
    vdpbf16ps pairs and 16-key trees, and rounds the softmax to bf16 before the
    product with V (as Hugging Face's eager attention casts it); the generic one keeps
    the probabilities in float32. Both must stay within bf16 rounding of a float64
    reference, and of each other: outputs here are under 4 in magnitude, where a bf16
    unit is 2^-6, so at most two units apart (measured: one, 2^-6), and 2^-10 on
    average (measured: ~2^-11.5; 40% of the outputs differ)."""
    out, (cache, metadata, q) = _attention(ops, both, torch.bfloat16, heads, kv_heads,
                                           head_dim, block_size)
    generic, avx512 = out["generic"].double(), out["avx512"].double()
    assert not torch.equal(generic, avx512), "set_isa did not change the path taken"
    reference = _reference(cache, metadata, q, head_dim)
    for name, got in out.items():
        error = (got.double() - reference).abs()
        assert error.max() <= 2 ** -5 and error.mean() < 2 ** -10, (name, error.max(), error.mean())
    difference = (generic - avx512).abs()
    assert difference.max() <= 2 ** -5 and difference.mean() < 2 ** -10, (
        difference.max(), difference.mean())


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 48)])
def test_paged_attention_without_an_avx512_path_is_equal(ops, both, dtype, head_dim):
    """float32, and bf16 at a head size the AVX-512 path does not take: one path."""
    out, _ = _attention(ops, both, dtype, 6, 2, head_dim, 8)
    assert torch.equal(out["generic"], out["avx512"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from .checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpts_isa")
    # llama: head_dim 16 (generic attention), SiLU on 16-lane blocks; qwen3: head_dim 32
    return {family: make_tiny_checkpoint(family, root / family) for family in ("llama", "qwen3")}


def _step_logits(path: str, native_layers: str, monkeypatch) -> list[torch.Tensor]:
    """bf16 logits of a prefill of two prompts (20 tokens: two query tiles, and 5),
    then three batched decodes."""
    from loom.model.loader import load_hf_config, load_model

    from .paged import PagedDriver

    from loom.model import kernel_replay

    monkeypatch.setenv("LOOM_NATIVE_LAYERS", native_layers)
    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)  # each shape recorded at once
    settings.cache_clear()  # loom.envs reads the environment once
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.bfloat16)
    driver = PagedDriver(model, num_blocks=32, block_size=4, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (20, 5)]
    logits = driver.step([(0, seqs[0], 20), (1, seqs[1], 5)])
    results, last = [logits], [logits[19], logits[24]]
    for _ in range(3):
        for seq, row in zip(seqs, last):
            seq.append(int(row.argmax()))
        logits = driver.step([(0, seqs[0], 1), (1, seqs[1], 1)])
        results.append(logits)
        last = [logits[0], logits[1]]
    replay = getattr(model, "kernel_replay", None)  # the decodes' second and third replayed
    assert (replay is not None and replay.stats.replayed == 2) == (native_layers == "1")
    return results


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_replay_equals_the_modules_under_each_isa(ops, both, checkpoints, family,
                                                         monkeypatch):
    """A replayed forward has no ISA split of its own: it calls the same kernels as the
    modules, so under either ISA it gives the modules' logits bit for bit."""
    if not ops.bf16_gemm_available():
        pytest.skip("no bf16_linear on this CPU")
    runs = both(lambda: {setting: _step_logits(checkpoints[family], setting, monkeypatch)
                         for setting in ("0", "1")})
    for isa, by_setting in runs.items():
        for modules, native in zip(by_setting["0"], by_setting["1"]):
            assert torch.equal(modules, native), isa
