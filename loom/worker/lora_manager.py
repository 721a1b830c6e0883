"""A rank's LoRA adapters (loom/lora.py): slots on the model's layers, adapters swapped
into them as their requests run, and each step's rows grouped by adapter (layers/lora.py).

Three tiers, as vLLM's LRU adapter managers:

- **registered** (``paths``): every adapter this rank serves, by name, with the directory
  it was read from (--lora-modules, an offline ``LoRARequest``, /v1/load_lora_adapter).
- **held** (``held``): up to ``max_cpu_loras`` adapters' tensors read, checked and cut to
  this rank's share, in host memory; the least recently used is dropped first and read
  from its directory again when a request next needs it.
- **slots** (``slots``): ``max_loras`` per layer, the only copies the forward reads. Before
  a step's forward (``token_slots``) each of its adapters is put in a slot: a held one is
  copied in, another read first; the slot given up is the least recently used one whose
  adapter the step does not run. The scheduler admits at most ``max_loras`` adapters
  among the running requests, so a step never needs more slots than there are.

Loading an adapter under a name it already has (``add``, or ``read`` then ``commit``:
the weight-update path, worker/weight_updates.py) replaces its tensors in every tier at
once, its slot in place: its requests run with the new weights from the next step.

An adapter's tensors arrive under PEFT's names
(``base_model.model.<module>.lora_A.weight`` (r, K) and ``lora_B.weight`` (N, r); on the
token embeddings ``lora_embedding_A`` (r, V) and ``lora_embedding_B`` (D, r)); a module
the checkpoint fuses (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``: the model's
``packed_modules_mapping``) takes it as one of its projections; a model whose load
reorders a checkpoint module's rows (ERNIE's q and k: rope pairs made halves) reorders its
adapter's B rows the same way (``lora_b_rows``). A llama.cpp LoRA GGUF's tensors are
mapped to PEFT's names first (loom/model/loader/gguf_loader.py: ``gguf_lora_weights``). A
module the base lacks (a routed expert among them), or a shape that does not fit the base
(an adapter trained on another model), is the adapter's error, raised before any tier
changes. PEFT's copies of the base embedding and LM head saved beside their adapters
(``base_layer.weight``, ``save_embedding_layers``) are checked for the base's shape and
not read: they are the base's own weights (as vLLM, which skips them too).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from loom.lora import AdapterConfig, AdapterError, is_gguf_adapter, read_adapter_config
from loom.model.kernel_replay import forget_recordings
from loom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from loom.model.layers.linear import (ColumnParallelLinear, LinearBase,
                                      MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from loom.model.layers.lora import EmbeddingLoRASlots, LoRASlots

logger = logging.getLogger(__name__)

_QKV_PARTS = {"q": 0, "k": 1, "v": 2}
EMBEDDING, HEAD = "model.embed_tokens", "lm_head"  # PEFT's names of the tables
_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B|lora_embedding_A|"
                  r"lora_embedding_B|base_layer)(?:\.weight)?")


@dataclass
class _Adapter:
    """An adapter read and checked: each (module, projection, A, B) of this rank."""

    config: AdapterConfig
    placed: list[tuple[nn.Module, int, torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype, self.device = dtype, device
        self.paths: dict[str, str] = {}  # registered: name -> directory
        self.held: OrderedDict[str, _Adapter] = OrderedDict()  # least recently used first
        self.slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self.step_slots: torch.Tensor | None = None  # the last step's slot of each token
        self.disk_reads = self.slot_loads = 0
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
        # the tables take slots when a first adapter targets them (their slots are a
        # vocabulary's rows each: none for engines whose adapters leave them alone)
        modules = dict(model.named_modules())
        embedding, head = modules.get(EMBEDDING), modules.get(HEAD)
        self.embedding = (embedding if isinstance(embedding, VocabParallelEmbedding)
                          and not isinstance(embedding, ParallelLMHead) else None)
        self.head = head if isinstance(head, ParallelLMHead) else None

    # ------------------------------------------------------------------ the tiers

    def add(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from ``path`` (read and checked now); an adapter of that
        name already served takes the new files."""
        self.commit(name, path, self.read(name, path))

    def read(self, name: str, path: str) -> _Adapter:
        """``path``'s adapter read and checked against this base, changing nothing."""
        config = read_adapter_config(path, self.max_rank)
        self.disk_reads += 1
        return _Adapter(config, self._place(name, path, self._read(path)))

    def commit(self, name: str, path: str, adapter: _Adapter) -> None:
        """Serve ``adapter`` (``read``) as ``name``: registered, held, and in its slot
        already if it has one (in place: an update)."""
        self.paths[name] = path
        self._hold(name, adapter)
        slot = self.slots.get(name)
        if slot is not None:
            self._fill(slot, adapter)
        logger.info("LoRA adapter %s (rank %d, %s) loaded%s", name, adapter.config.rank,
                    ", ".join(adapter.config.target_modules),
                    "" if slot is None else f" into slot {slot}")

    def remove(self, name: str) -> bool:
        if self.paths.pop(name, None) is None:
            return False
        self.held.pop(name, None)
        slot = self.slots.pop(name, None)
        if slot is not None:
            for slots in self._slot_modules():
                slots.clear(slot)
        return True

    def stats(self) -> dict:
        """The tiers now: each slot's adapter, the held ones (least recently used first),
        the registered ones, and how many adapters were read from disk and copied into a
        slot so far."""
        return {"slots": dict(self.slots), "held": list(self.held),
                "registered": sorted(self.paths), "disk_reads": self.disk_reads,
                "slot_loads": self.slot_loads}

    def _hold(self, name: str, adapter: _Adapter) -> None:
        self.held[name] = adapter
        self.held.move_to_end(name)
        while len(self.held) > self.max_cpu_loras:
            dropped, _ = self.held.popitem(last=False)
            logger.debug("LoRA adapter %s dropped from host memory", dropped)

    def _activate(self, name: str, step: set[str]) -> int:
        """``name``'s slot, its adapter copied in now if it had none."""
        slot = self.slots.get(name)
        if slot is not None:
            self.slots.move_to_end(name)
            return slot
        path = self.paths.get(name)
        if path is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded on this rank")
        adapter = self.held.get(name)
        if adapter is None:  # dropped from host memory: read again
            adapter = self.read(name, path)
        self._hold(name, adapter)
        taken = set(self.slots.values())
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((other for other in self.slots if other not in step), None)
            if victim is None:
                raise AdapterError(f"a step runs {len(step)} LoRA adapters, more than "
                                   f"max_loras {self.max_loras}")
            slot = self.slots.pop(victim)
        self._fill(slot, adapter)
        self.slots[name] = slot
        self.slot_loads += 1
        return slot

    def _fill(self, slot: int, adapter: _Adapter) -> None:
        for slots in self._slot_modules():
            slots.clear(slot)
        for module, part, a, b in adapter.placed:
            slots = self._slots_of(module)
            if isinstance(slots, EmbeddingLoRASlots):
                slots.load(slot, a, b, adapter.config.scale)
            else:
                slots.load(slot, part, a, b, adapter.config.scale)

    def _slot_modules(self) -> list[LoRASlots | EmbeddingLoRASlots]:
        tables = [t.lora for t in (self.embedding, self.head)
                  if t is not None and t.lora is not None]
        return [layer.lora for layer in self.layers.values()] + tables

    def _slots_of(self, module: nn.Module) -> LoRASlots | EmbeddingLoRASlots:
        """``module``'s slots, a table's made at its first adapter."""
        if module.lora is None:
            if module is self.embedding:
                module.lora = EmbeddingLoRASlots(module.num_embeddings, module.embedding_dim,
                                                 self.max_loras, self.max_rank, self.dtype,
                                                 self.device)
                forget_recordings(self.model)  # recorded without the embedding's adapters
            else:
                module.lora = LoRASlots(module.embedding_dim, [module.num_embeddings_per_rank],
                                        self.max_loras, self.max_rank, self.dtype, self.device)
        return module.lora

    # ------------------------------------------------------------------ the step

    def token_slots(self, lora_names: list[str | None], query_lens: list[int]) -> torch.Tensor:
        """Each token's adapter slot this step (-1: the base), requests in step order; the
        step's adapters are put in slots first."""
        step = {name for name in lora_names if name is not None}
        slot_of: dict[str | None, int] = {None: -1}
        for name in lora_names:
            if name not in slot_of:
                slot_of[name] = self._activate(name, step)
        per_request = torch.tensor([slot_of[name] for name in lora_names], dtype=torch.long)
        slots = per_request.repeat_interleave(torch.tensor(query_lens, dtype=torch.long))
        self.step_slots = slots.to(self.device)
        return self.step_slots

    @contextmanager
    def logits_of(self, rows: torch.Tensor | slice | None):
        """While the LM head computes the logits of the step's token rows ``rows`` (None:
        all of them), it adds their requests' adapters."""
        head = self.head.lora if self.head is not None else None
        if head is None or self.step_slots is None:
            yield
            return
        head.rows = self.step_slots if rows is None else self.step_slots[rows]
        try:
            yield
        finally:
            head.rows = None

    # ------------------------------------------------------------------ loading

    def _read(self, path: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's names (a llama.cpp GGUF's mapped to them,
        its scales folded into B: gguf_loader.gguf_lora_weights)."""
        from safetensors.torch import load_file

        if is_gguf_adapter(path):
            from loom.model.loader.gguf_loader import gguf_lora_weights
            from loom.model.models.registry import get_model_architecture

            config = self.model.config
            return gguf_lora_weights(path, config, get_model_architecture(config))

        try:
            return load_file(f"{path}/adapter_model.safetensors")
        except Exception as error:  # noqa: BLE001 — a truncated or corrupt file
            raise AdapterError(f"LoRA adapter {path!r}: adapter_model.safetensors cannot be "
                               f"read: {error}") from None

    def _place(self, name: str, path: str, tensors: dict[str, torch.Tensor]
               ) -> list[tuple[nn.Module, int, torch.Tensor, torch.Tensor]]:
        """Each (A, B) pair of the adapter with the module and projection it goes to."""
        mapping = getattr(self.model, "packed_modules_mapping", {})
        reorder = getattr(self.model, "lora_b_rows", None)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.fullmatch(key)
            if match is None:
                raise AdapterError(f"LoRA adapter {name!r} ({path}) holds {key!r}, which is not "
                                   "a lora_A or lora_B weight")
            module, which = match.groups()
            if which == "base_layer":
                self._check_base_copy(name, module, tensor)
                continue
            pairs.setdefault(module, {})[which.removeprefix("lora_embedding_")
                                         .removeprefix("lora_")] = tensor
        placed = []
        for module, pair in sorted(pairs.items()):
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"LoRA adapter {name!r}: {module} has only "
                                   f"{', '.join(pair)} of A and B")
            a, b = pair["A"], pair["B"]
            if module == EMBEDDING and self.embedding is not None:
                placed.append(self._place_embedding(name, a, b))
                continue
            if module == HEAD and self.head is not None:
                placed.append(self._place_head(name, a, b))
                continue
            prefix, _, leaf = module.rpartition(".")
            part = 0
            if leaf in mapping:
                packed, shard = mapping[leaf]
                leaf, part = packed, _QKV_PARTS.get(shard, shard)
            layer = self.layers.get(f"{prefix}.{leaf}")
            if layer is None and ".experts." in f"{module}.":
                raise AdapterError(f"LoRA adapter {name!r} targets {module}, a routed expert; "
                                   "loom applies adapters to the attention, shared experts and "
                                   "dense MLPs of a mixture of experts, not its routed experts")
            if layer is None:
                raise AdapterError(f"LoRA adapter {name!r} targets {module}, which this base "
                                   "model does not have (or loom does not adapt)")
            inputs, outputs = _full_sizes(layer, part)
            if a.shape[1] != inputs or b.shape[0] != outputs or a.shape[0] != b.shape[1]:
                raise AdapterError(
                    f"LoRA adapter {name!r}: {module}'s A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)} do not fit this base's layer of {inputs} inputs and "
                    f"{outputs} outputs; was it trained on another base model?")
            if reorder is not None:  # rows the model reorders at load (ERNIE's q and k)
                b = reorder(module, b)
            a, b = _shard(layer, part, a, b)
            placed.append((layer, part, a, b))
        if not placed:
            raise AdapterError(f"LoRA adapter {name!r} ({path}) holds no LoRA weights")
        return placed

    def _place_embedding(self, name: str, a: torch.Tensor, b: torch.Tensor):
        """PEFT's lora_embedding_A (r, V) and lora_embedding_B (D, r), whole on every rank
        (added after the embedding's all-reduce)."""
        table = self.embedding
        if a.shape[1] != table.num_embeddings or b.shape[0] != table.embedding_dim \
                or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"LoRA adapter {name!r}: embed_tokens' A {tuple(a.shape)} and B "
                f"{tuple(b.shape)} do not fit this base's {table.num_embeddings} x "
                f"{table.embedding_dim} table; was it trained on another base model (or a "
                "resized vocabulary)?")
        return table, 0, a, b

    def _place_head(self, name: str, a: torch.Tensor, b: torch.Tensor):
        """The LM head's A (r, D) whole and B (V, r) cut as the head's vocabulary range on
        this rank (its padding rows zero)."""
        head = self.head
        if a.shape[1] != head.embedding_dim or b.shape[0] != head.num_embeddings \
                or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"LoRA adapter {name!r}: lm_head's A {tuple(a.shape)} and B {tuple(b.shape)} "
                f"do not fit this base's head of {head.embedding_dim} inputs and "
                f"{head.num_embeddings} outputs; was it trained on another base model (or a "
                "resized vocabulary)?")
        mine = b.new_zeros(head.num_embeddings_per_rank, b.shape[1])
        end = min(head.vocab_end, head.num_embeddings)
        mine[:max(end - head.vocab_start, 0)] = b[head.vocab_start:end]
        return head, 0, a, mine

    def _check_base_copy(self, name: str, module: str, tensor: torch.Tensor) -> None:
        table = {EMBEDDING: self.embedding, HEAD: self.head}.get(module)
        if table is None:
            raise AdapterError(f"LoRA adapter {name!r} holds {module}'s whole weight "
                               "(base_layer), which loom does not serve")
        if tuple(tensor.shape) != (table.num_embeddings, table.embedding_dim):
            raise AdapterError(
                f"LoRA adapter {name!r} holds a {module} of {tuple(tensor.shape)}, not this "
                f"base's {table.num_embeddings} x {table.embedding_dim}: a resized vocabulary, "
                "which loom does not serve")


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
    if isinstance(layer, RowParallelLinear):  # (copies: a held share keeps no more)
        return a[:, group.rank * layer.input_size:(group.rank + 1) * layer.input_size].clone(), b
    size = layer.lora.part_sizes[part]
    index = group.rank
    if isinstance(layer, QKVParallelLinear) and part > 0:
        index = group.rank // layer.num_kv_head_replicas
    return a, b[index * size:(index + 1) * size].clone()
