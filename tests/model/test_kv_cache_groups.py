"""Which attention layers share a block table (loom/model/attention/kv_cache_groups.py)."""

from __future__ import annotations

import pytest

from loom.model.attention.kv_cache_groups import KVCacheGroups

W = 512


def test_gemma3_layers_split_into_one_kind_per_group():
    """12 layers, 5 local to 1 global: groups of 2 (the global count), full first."""
    windows = [None if i % 6 == 5 else W for i in range(12)]
    groups = KVCacheGroups.of(windows)
    assert groups.windows == (None, W, W, W, W, W)
    assert groups.group_of_layer == (1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0)
    assert groups.slot_of_layer == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)
    assert groups.layers_per_block == 2
    # every group's layers use distinct slots: a block's slots are never shared within one
    for group in range(len(groups.windows)):
        slots = [s for g, s in zip(groups.group_of_layer, groups.slot_of_layer) if g == group]
        assert len(slots) == len(set(slots))


def test_counts_that_do_not_divide_leave_a_slot_unused():
    """26 layers (Gemma 3 1B): 4 global, 22 local -> groups of 4; the last local group
    has 2 layers."""
    windows = [None if i % 6 == 5 else W for i in range(26)]
    groups = KVCacheGroups.of(windows)
    assert groups.windows == (None,) + (W,) * 6
    assert groups.layers_per_block == 4
    assert sorted(groups.group_of_layer).count(6) == 2


def test_one_group_when_layers_agree_or_hybrid_is_off():
    assert KVCacheGroups.of([W, W, W]).windows == (W,)  # Mistral: one sliding group
    assert KVCacheGroups.of([None, None]).windows == (None,)
    plain = KVCacheGroups.of([W, None, W], hybrid=False)  # e.g. speculative decoding
    assert plain.windows == (None,) and plain.layers_per_block == 3
    assert plain.slot_of_layer == (0, 1, 2)
    assert KVCacheGroups.of([W, None, 8]).windows == (None,)  # two window sizes


@pytest.mark.parametrize("options, num_groups", [
    (dict(), 3),  # global, local, local: a hybrid cache
    (dict(splitwise_role="decode", kv_transfer_config={"kv_transport": "tcp"}), 1),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), 1)])
def test_gemma3_runner_is_hybrid_unless_a_transfer_or_drafts_need_one_table(
        tmp_path, options, num_groups):
    """The runner's layout, which the engine's scheduler follows: a KV transfer moves one
    block table, and drafts' rolled-back K/V is not accounted for per group."""
    import torch

    from loom.engine_args import make_engine_config
    from loom.worker.model_runner import ModelRunner

    from .checkpoints import SLIDING_WINDOW, make_tiny_checkpoint

    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    config = make_engine_config(path, dtype="float32", max_model_len=64,
                                skip_tokenizer_init=True, **options)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    groups = runner.kv_cache_groups
    assert len(groups.windows) == num_groups
    assert runner.kv_cache_group_counts == (num_groups, 1)
    assert runner.kv_cache_window == (SLIDING_WINDOW if num_groups > 1 else 0)
    assert groups.layers_per_block == (1 if num_groups > 1 else 3)


def test_drafts_keep_every_block_of_an_all_sliding_model(tmp_path):
    """Found in review: a Mistral with a window under speculative decoding had its
    blocks behind the window freed again (one group keeps its window), while a draft
    model's full-attention layers read the target's tables. With drafts, none is freed."""
    import torch

    from loom.engine_args import make_engine_config
    from loom.worker.model_runner import ModelRunner

    from .checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint("mistral_sliding", tmp_path / "mistral")
    runners = {}
    for name, options in (("plain", {}), ("drafts", dict(speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}))):
        config = make_engine_config(path, dtype="float32", max_model_len=64,
                                    skip_tokenizer_init=True, **options)
        runners[name] = ModelRunner(config, torch.device("cpu"))
        runners[name].load_model()
    assert runners["plain"].kv_cache_window > 0
    assert runners["drafts"].kv_cache_window == 0
    assert runners["drafts"].kv_cache_groups.windows == (None,)
