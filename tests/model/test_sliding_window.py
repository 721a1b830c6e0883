"""Sliding-window attention: each query sees only the last W keys up to its own position,
in the torch reference backend and the CPU kernel, through chunked prefill and decode,
and models with windows equal transformers on prompts longer than the window."""

from __future__ import annotations

import pytest
import torch

from loom.model.attention.cpu_backend import CpuAttentionBackend
from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.torch_backend import TorchAttentionBackend
from loom.model.loader import load_hf_config, load_model

from .checkpoints import SLIDING_WINDOW, make_tiny_checkpoint
from .paged import PagedDriver


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
               window: int, scale: float) -> torch.Tensor:
    """Dense float64 attention of queries at ``positions`` over keys 0..S-1."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    out = []
    for row, pos in enumerate(positions):
        lo = max(0, pos - window + 1)
        scores = torch.einsum("hd,shd->hs", q[row].double(), k[lo:pos + 1]) * scale
        out.append(torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo:pos + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, CpuAttentionBackend])
def test_backends_mask_keys_outside_the_window(backend_cls, dtype):
    """Two requests in one step: a 40-token context whose last 9 tokens are new (a
    prefill chunk) and a 30-token one decoding; window 7, head_dim 32 (the bf16 kernel's
    AVX-512 path). Every output equals dense attention over the window."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, window = 4, 2, 32, 4, 7
    backend = backend_cls(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window)
    contexts, new = [40, 30], [9, 1]
    keys = [torch.randn(n, kv_heads, head_dim).to(dtype) for n in contexts]
    values = [torch.randn(n, kv_heads, head_dim).to(dtype) for n in contexts]
    queries = [torch.randn(m, heads, head_dim).to(dtype) for m in new]
    kv_cache = torch.zeros(backend.kv_cache_shape(32, block_size), dtype=dtype)
    tables = [list(range(1, 11)), list(range(31, 23, -1))]
    width = max(map(len, tables))
    # the cached part of each context, written as an earlier step would have
    for table, n, m, k, v in zip(tables, contexts, new, keys, values):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(n - m)])
        TorchAttentionBackend._write_kv(k[:n - m], v[:n - m], kv_cache, slots)
    slots = [table[p // block_size] * block_size + p % block_size
             for table, n, m in zip(tables, contexts, new) for p in range(n - m, n)]
    starts = [0, new[0], new[0] + new[1]]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=contexts, max_query_len=max(new),
        max_seq_len=max(contexts), block_size=block_size)
    out = backend.forward(torch.cat(queries), torch.cat([k[-m:] for k, m in zip(keys, new)]),
                          torch.cat([v[-m:] for v, m in zip(values, new)]), kv_cache, metadata)
    expected = torch.cat([
        _reference(q, k, v, list(range(n - m, n)), window, head_dim ** -0.5)
        for q, k, v, n, m in zip(queries, keys, values, contexts, new)])
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    # and the window does something: full causal attention differs
    full = _reference(queries[1], keys[1], values[1], [contexts[1] - 1], 10 ** 6, head_dim ** -0.5)
    assert not torch.allclose(full, expected[-1:], atol=1e-2)


@pytest.mark.parametrize("family", ["mistral_sliding", "gemma3"])
@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_prompt_longer_than_the_window_equals_transformers(tmp_path, family,
                                                           attention_backend):
    """A 45-token prompt (window 12) prefilled in chunks of 20, 20, 5, then 6 decodes:
    every step's logits equal transformers' over the whole sequence."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(family, tmp_path / family)
    config = load_hf_config(path)
    assert SLIDING_WINDOW == 12
    model = load_model(path, config, dtype=torch.float32, attention_backend=attention_backend)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, config.vocab_size, (45,), generator=generator).tolist()
    driver = PagedDriver(model, num_blocks=32, block_size=4)
    seen, logits = 0, None
    for chunk in (20, 20, 5, 1, 1, 1, 1, 1, 1):
        if seen + chunk > len(tokens):
            tokens.append(int(logits[-1].argmax()))
        seen += chunk
        logits = driver.step([(0, tokens[:seen], chunk)])
        with torch.no_grad():
            expected = hf(torch.tensor([tokens[:seen]])).logits[0, -chunk:]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config_cls", ["Qwen2Config", "Qwen3Config"])
def test_layer_types_set_the_window_per_layer(tmp_path, config_cls):
    """Qwen2/Qwen3 with use_sliding_window: the layers from max_window_layers on attend
    over the window (config.layer_types), the first ones over everything; a 30-token
    prompt and decodes equal transformers."""
    import transformers
    from transformers import AutoModelForCausalLM

    from .checkpoints import _COMMON

    config = getattr(transformers, config_cls)(
        **_COMMON | dict(num_hidden_layers=3), vocab_size=256, use_sliding_window=True,
        sliding_window=8, max_window_layers=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.norm.weight.mul_(8.0)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), dtype=torch.float32)
    assert [layer.attention.sliding_window for layer in model.model.layers] == [None, 8, 8]
    tokens = list(range(3, 33))
    driver = PagedDriver(model, num_blocks=32, block_size=4)
    logits = driver.step([(0, tokens, 30)])
    decoded = driver.step([(0, tokens + [7], 1)])
    with torch.no_grad():
        expected = hf(torch.tensor([tokens + [7]])).logits[0]
    torch.testing.assert_close(torch.cat([logits, decoded]), expected, atol=1e-4, rtol=1e-4)
