"""A rank's LoRA adapters (loom/lora.py): slots on the model's decoder linears, adapters
loaded into them by name, and each step's rows grouped by adapter (layers/lora.py).

An adapter's tensors arrive under PEFT's names (``base_model.model.<module>.lora_A.weight``
(r, K) and ``lora_B.weight`` (N, r)); a module the checkpoint fuses (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``: the model's ``packed_modules_mapping``) takes
it as one of its projections. A module the base lacks, or a shape that does not fit the
base (an adapter trained on another model), is the adapter's error, raised before any
slot changes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loom.lora import AdapterError, read_adapter_config
from loom.model.layers.linear import (ColumnParallelLinear, LinearBase,
                                      MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from loom.model.layers.lora import LoRASlots

logger = logging.getLogger(__name__)

_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.layers: dict[str, LinearBase] = {}
        decoder = getattr(getattr(model, "model", None), "layers", None)
        if decoder is None:
            raise ValueError(f"{type(model).__name__} has no decoder layers for LoRA adapters")
        for name, module in model.named_modules():
            if not name.startswith("model.layers.") or not isinstance(module, LinearBase):
                continue
            if ".experts" in name:
                continue  # routed experts take no adapter (loom/lora.py)
            if isinstance(module, QKVParallelLinear):
                parts = [module.q_size, module.kv_size, module.kv_size]
            elif isinstance(module, MergedColumnParallelLinear):
                parts = [size // module.tp_group.world_size for size in module.output_sizes]
            else:
                parts = [module.output_size]
            module.lora = LoRASlots(module.input_size, parts, max_loras, max_rank, dtype, device)
            self.layers[name] = module

    def add(self, name: str, path: str) -> int:
        """Load adapter ``name`` from ``path`` into a free slot; its slot. An adapter of
        that name already loaded is replaced."""
        config = read_adapter_config(path, self.max_rank)
        tensors = self._read(path)
        placed = self._place(name, path, tensors)
        slot = self.slots.get(name)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
            if not free:
                raise AdapterError(f"LoRA adapter {name!r}: all {self.max_loras} slots hold "
                                   f"adapters ({', '.join(sorted(self.slots))}); raise "
                                   "--max-loras or unload one")
            slot = free[0]
        for layer in self.layers.values():
            layer.lora.clear(slot)
        for layer, part, a, b in placed:
            layer.lora.load(slot, part, a, b, config.scale)
        self.slots[name] = slot
        logger.info("LoRA adapter %s (rank %d, %s) loaded into slot %d", name, config.rank,
                    ", ".join(config.target_modules), slot)
        return slot

    def remove(self, name: str) -> bool:
        slot = self.slots.pop(name, None)
        if slot is None:
            return False
        for layer in self.layers.values():
            layer.lora.clear(slot)
        return True

    def token_slots(self, lora_names: list[str | None], query_lens: list[int]) -> torch.Tensor:
        """Each token's adapter slot this step (-1: the base), requests in step order."""
        slots = []
        for name, count in zip(lora_names, query_lens):
            slot = -1
            if name is not None:
                slot = self.slots.get(name, -2)
                if slot == -2:
                    raise AdapterError(f"LoRA adapter {name!r} is not loaded on this rank")
            slots += [slot] * count
        return torch.tensor(slots, dtype=torch.long)

    # ------------------------------------------------------------------ loading

    @staticmethod
    def _read(path: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        try:
            return load_file(f"{path}/adapter_model.safetensors")
        except Exception as error:  # noqa: BLE001 — a truncated or corrupt file
            raise AdapterError(f"LoRA adapter {path!r}: adapter_model.safetensors cannot be "
                               f"read: {error}") from None

    def _place(self, name: str, path: str, tensors: dict[str, torch.Tensor]
               ) -> list[tuple[LinearBase, int, torch.Tensor, torch.Tensor]]:
        """Each (A, B) pair of the adapter with the layer and projection it goes to."""
        mapping = getattr(self.model, "packed_modules_mapping", {})
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            for which in ("lora_A", "lora_B"):
                marker = f".{which}."
                if marker in key:
                    module = key.split(marker)[0].removeprefix("base_model.model.")
                    pairs.setdefault(module, {})[which] = tensor
                    break
            else:
                raise AdapterError(f"LoRA adapter {name!r} ({path}) holds {key!r}, which is not "
                                   "a lora_A or lora_B weight")
        placed = []
        for module, pair in sorted(pairs.items()):
            if set(pair) != {"lora_A", "lora_B"}:
                raise AdapterError(f"LoRA adapter {name!r}: {module} has only {', '.join(pair)}")
            prefix, _, leaf = module.rpartition(".")
            part = 0
            if leaf in mapping:
                packed, shard = mapping[leaf]
                leaf, part = packed, _QKV_PARTS.get(shard, shard)
            layer = self.layers.get(f"{prefix}.{leaf}")
            if layer is None:
                raise AdapterError(f"LoRA adapter {name!r} targets {module}, which this base "
                                   "model does not have (or loom does not adapt)")
            a, b = pair["lora_A"], pair["lora_B"]
            inputs, outputs = _full_sizes(layer, part)
            if a.shape[1] != inputs or b.shape[0] != outputs or a.shape[0] != b.shape[1]:
                raise AdapterError(
                    f"LoRA adapter {name!r}: {module}'s A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)} do not fit this base's layer of {inputs} inputs and "
                    f"{outputs} outputs; was it trained on another base model?")
            a, b = _shard(layer, part, a, b)
            placed.append((layer, part, a, b))
        if not placed:
            raise AdapterError(f"LoRA adapter {name!r} ({path}) holds no LoRA weights")
        return placed


def _full_sizes(layer: LinearBase, part: int) -> tuple[int, int]:
    """The whole model's inputs and ``part``'s outputs of ``layer`` (this rank holds a
    shard of one of them under tensor parallel)."""
    ranks = layer.tp_group.world_size
    if isinstance(layer, RowParallelLinear):
        return layer.input_size * ranks, layer.output_size
    if isinstance(layer, QKVParallelLinear):
        heads = layer.num_heads if part == 0 else layer.num_kv_heads
        replicas = 1 if part == 0 else layer.num_kv_head_replicas
        return layer.input_size, heads * layer.head_size * ranks // replicas
    if isinstance(layer, ColumnParallelLinear):
        return layer.input_size, layer.lora.part_sizes[part] * ranks
    return layer.input_size, layer.output_size


def _shard(layer: LinearBase, part: int, a: torch.Tensor,
           b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of an adapter's A and B, cut as the base layer is: a
    row-parallel layer's inputs (A's columns; the partial products sum in its
    all-reduce), a column-parallel one's outputs (B's rows; a KV head replicated over
    ranks is the same rows on each)."""
    group = layer.tp_group
    if group.world_size == 1:
        return a, b
    if isinstance(layer, RowParallelLinear):
        return a[:, group.rank * layer.input_size:(group.rank + 1) * layer.input_size], b
    size = layer.lora.part_sizes[part]
    index = group.rank
    if isinstance(layer, QKVParallelLinear) and part > 0:
        index = group.rank // layer.num_kv_head_replicas
    return a, b[index * size:(index + 1) * size]
