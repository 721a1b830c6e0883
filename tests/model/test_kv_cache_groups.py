"""Which attention layers share a block table (loom/model/attention/kv_cache_groups.py)."""

from __future__ import annotations

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
