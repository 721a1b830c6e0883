"""KV cache groups: which attention layers share a block table (vLLM's hybrid KV cache).

A model whose layers all read every position, or all the same sliding window, has one
group: one block table per request, every layer's cache indexed by it. A model that
mixes the two (Gemma 3: five local layers with window W to one global layer) gets
groups of equally many layers, full-attention groups first, each with its own block
table, so that the scheduler can free a sliding group's blocks once they leave the
window while the full groups keep theirs (core/kv_cache_manager.py).

The pool's blocks are interchangeable between groups: layer i of every group uses
cache slot i (one tensor per slot), and a block belongs to one group at a time, so a
block is ``layers_per_block`` layers' K/V for ``block_size`` positions:

    Gemma 3, 12 layers (L = local, G = global), 2 per group:
    layers      0L 1L 2L 3L 4L 5G 6L 7L 8L 9L 10L 11G
    groups      full: [5, 11]  window: [0, 1] [2, 3] [4, 6] [7, 8] [9, 10]
    slot        5 -> 0, 11 -> 1, 0 -> 0, 1 -> 1, 2 -> 0, 3 -> 1, ...

The group size is the smaller of the two layer counts (vLLM's choice: no group mixes
kinds, and the larger kind splits into whole groups where the counts divide; where they
do not, the last group of a kind leaves a slot unused).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # each group's sliding window; None: full attention
    group_of_layer: tuple[int, ...]  # per attention layer, in model order
    slot_of_layer: tuple[int, ...]  # per attention layer: its cache slot within a block

    @property
    def layers_per_block(self) -> int:
        return max(self.slot_of_layer, default=-1) + 1

    @classmethod
    def of(cls, layer_windows: list[int | None], hybrid: bool = True) -> KVCacheGroups:
        """Groups for attention layers with these sliding windows (None: full).
        ``hybrid=False``, or windows of more than one size: one group, whose window is
        the layers' common one, else None (every block kept)."""
        num_layers = len(layer_windows)
        kinds = set(layer_windows)
        single = cls((None,), (0,) * num_layers, tuple(range(num_layers)))
        if len(kinds) == 1:
            return cls((layer_windows[0] if layer_windows else None,), single.group_of_layer,
                       single.slot_of_layer)
        if not hybrid or len(kinds) != 2 or None not in kinds:
            return single
        window = next(w for w in kinds if w is not None)
        full = [i for i, w in enumerate(layer_windows) if w is None]
        local = [i for i, w in enumerate(layer_windows) if w is not None]
        size = min(len(full), len(local))
        windows: list[int | None] = []
        group_of_layer, slot_of_layer = [0] * num_layers, [0] * num_layers
        for layers, group_window in ((full, None), (local, window)):
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    group_of_layer[layer], slot_of_layer[layer] = len(windows), slot
                windows.append(group_window)
        return cls(tuple(windows), tuple(group_of_layer), tuple(slot_of_layer))
