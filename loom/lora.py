"""LoRA adapters: many fine-tunes of one base model served together (torch-free).

An adapter in PEFT's format (a directory with ``adapter_config.json`` and
``adapter_model.safetensors``), or llama.cpp's LoRA GGUF (one ``.gguf`` file, written by
its ``convert_lora_to_gguf.py``; loom/model/loader/gguf_loader.py maps its tensors back to
the model's modules), adds ``scale * B (A x)`` to each linear layer it targets,
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; a GGUF's is
llama.cpp's, ``alpha / r`` always, as its converter keeps no ``use_rslora``), and
``scale * B A^T[id]`` to the embedding of token ``id`` where it targets the embeddings.
loom applies it beside the base weight, never merged into it, so requests for different
adapters and for the base share a step (loom/model/layers/lora.py: each step's rows
grouped by adapter, each group's shrink and expand products in turn).

An engine started with ``enable_lora`` serves any number of adapters (loaded at
start-up from ``--lora-modules name=path``, on first use from an offline ``LoRARequest``,
or by /v1/load_lora_adapter); ``max_loras`` of them, of rank up to ``max_lora_rank``, sit
in the ranks' slots at once. The scheduler admits a request only while the running
requests use at most ``max_loras`` adapters (one more waits, in order, without holding
up the others), and a rank swaps adapters into its slots as their requests run (the
least recently used slot not needed by the step). ``max_cpu_loras`` adapters' weights
stay read in host memory besides the slots (least recently used dropped first, read
from disk again when next needed). A request names an adapter by its name (the OpenAI
routes' ``model``; ``SamplingParams.lora_name``), the base by the served model name.
Prefix caching keys a request's blocks by its adapter and that adapter's load id
(``SamplingParams.lora_id``), so an adapter loaded again or updated in place
(``LLM.update_weights(path, lora_name=...)``) never reuses its old blocks.

Targets: the attention and MLP projections of the dense families; of the mixtures of
experts the attention, the shared experts' projections (ERNIE 4.5 MoE's
``mlp.shared_experts.gate_proj`` ...) and the MLPs of their dense layers (``q_proj k_proj
v_proj o_proj gate_proj up_proj down_proj``, by module name); the token embeddings
(``embed_tokens``: PEFT's ``lora_embedding_A``/``lora_embedding_B``) and the LM head
(``lm_head``). An adapter on anything else (the routed experts, a router, a vision
tower), with a rank above ``max_lora_rank``, with ``modules_to_save`` (whole trained
copies of modules) or DoRA, is refused with the reason: nothing it holds is ignored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter a request runs with, by name; its files are read when the name
    is new or ``lora_path`` differs from the path it was loaded from (``lora_int_id`` is
    vLLM's handle, kept but not used: loom numbers each load itself)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class AdapterConfig:
    """What loom reads of an adapter's ``adapter_config.json``."""

    rank: int
    scale: float
    target_modules: tuple[str, ...]
    base_model: str | None


class AdapterError(ValueError):
    """An adapter loom cannot serve: the message names the adapter and the reason."""


def read_adapter_config(path: str, max_rank: int,
                        base_architecture: str | None = None) -> AdapterConfig:
    """``path``'s adapter configuration, checked against what loom serves: a PEFT
    directory, or a file: llama.cpp's LoRA GGUF (``read_gguf_adapter_config``; with
    ``base_architecture``, the base's loom architecture, its architecture checked too)."""
    if is_gguf_adapter(path):
        return read_gguf_adapter_config(path, max_rank, base_architecture)
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise AdapterError(f"LoRA adapter {path!r} has no adapter_config.json (PEFT's format: "
                           "adapter_config.json and adapter_model.safetensors; or give "
                           "llama.cpp's LoRA .gguf file)")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise AdapterError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise AdapterError(f"LoRA adapter {path!r}: adapter_config.json is not JSON: "
                           f"{error}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path!r} is a {raw.get('peft_type')} adapter; loom "
                           "serves LORA")
    rank = int(raw.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"LoRA adapter {path!r} has rank {rank}, above --max-lora-rank "
                           f"{max_rank}; raise --max-lora-rank")
    if raw.get("use_dora"):
        raise AdapterError(f"LoRA adapter {path!r} uses DoRA, which loom does not serve")
    if raw.get("modules_to_save"):
        raise AdapterError(
            f"LoRA adapter {path!r} saves whole trained copies of "
            f"{', '.join(raw['modules_to_save'])} (modules_to_save), which loom does not "
            "serve: it applies LoRA's A and B beside the base weights only; train with those "
            "modules in target_modules instead (embed_tokens and lm_head included)")
    for field, what in (("trainable_token_indices", "trained rows of the token embeddings"),
                        ("target_parameters", "LoRA on parameters (experts)")):
        if raw.get(field):
            raise AdapterError(f"LoRA adapter {path!r} holds {what} ({field}), which loom "
                               "does not serve")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterError(f"LoRA adapter {path!r} names its targets by pattern ({targets!r}); "
                           "loom takes a list of module names")
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise AdapterError(f"LoRA adapter {path!r} targets {', '.join(unsupported)}; loom "
                           f"applies adapters to {', '.join(SUPPORTED_TARGETS)}")
    alpha = float(raw.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scale, tuple(targets), raw.get("base_model_name_or_path"))


def read_gguf_adapter_config(path: str, max_rank: int,
                             base_architecture: str | None = None) -> AdapterConfig:
    """A llama.cpp LoRA adapter (``convert_lora_to_gguf.py``): ``general.type`` adapter,
    ``adapter.type`` lora, ``adapter.lora.alpha``, and an A and a B for each tensor it
    adapts (``blk.N.attn_q.weight.lora_a`` (r, in) and ``.lora_b`` (out, r)). Each pair's
    scale is llama.cpp's, ``alpha / r`` with its own r (1 where alpha is 0): the
    converter writes PEFT's ``lora_alpha`` and nothing of ``use_rslora`` or
    ``rank_pattern``. The worker folds it into each B as it reads the tensors
    (loom/model/loader/gguf_loader.py: ``gguf_lora_weights``), so ``scale`` here is 1;
    ``target_modules`` are llama.cpp's tensor kinds (``attn_q``, ``ffn_down``, ...)."""
    from loom.model.loader.gguf_file import GGUFFile

    try:
        gguf_file = GGUFFile(path)
    except (OSError, ValueError) as error:
        raise AdapterError(f"LoRA adapter {path!r} is neither a PEFT adapter directory nor "
                           f"a readable GGUF file: {error}") from None
    metadata = gguf_file.metadata
    kind = metadata.get("general.type", "model")
    if kind != "adapter":
        raise AdapterError(f"LoRA adapter {path!r} is a GGUF {kind} (general.type), not a "
                           "LoRA adapter: convert the PEFT adapter with llama.cpp's "
                           "convert_lora_to_gguf.py")
    if metadata.get("adapter.type") != "lora":
        raise AdapterError(f"LoRA adapter {path!r} is a GGUF {metadata.get('adapter.type')} "
                           "adapter (adapter.type); loom serves lora")
    if base_architecture is not None:
        check_gguf_adapter_architecture(path, metadata.get("general.architecture"),
                                        base_architecture)
    if len(metadata.get("adapter.alora.invocation_tokens", ())):
        raise AdapterError(f"LoRA adapter {path!r} is an activated LoRA "
                           "(adapter.alora.invocation_tokens), which loom does not serve")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in gguf_file.tensors.items():
        base, dot, half = name.rpartition(".")
        if not dot or half not in ("lora_a", "lora_b"):
            raise AdapterError(f"LoRA adapter {path!r} holds {name}, which is not a lora_a or "
                               "lora_b tensor (whole weights, such as mergekit's norms, are "
                               "not served)")
        halves.setdefault(base, {})[half] = info.shape
    if not halves:
        raise AdapterError(f"LoRA adapter {path!r} holds no LoRA tensors")
    ranks = []
    for base, pair in sorted(halves.items()):
        if len(pair) != 2:
            raise AdapterError(f"LoRA adapter {path!r}: {base} has only its "
                               f"{', '.join(pair)}")
        ranks.append(pair["lora_b"][-1])
    rank = max(ranks)
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {path!r} has rank {rank}, above --max-lora-rank "
                           f"{max_rank}; raise --max-lora-rank")
    targets = sorted({base.rsplit(".", 2)[-2] for base in halves})
    return AdapterConfig(rank, 1.0, tuple(targets), metadata.get("general.base_model.0.name"))


def check_gguf_adapter_architecture(path: str, architecture: str | None,
                                    base_architecture: str) -> None:
    """A GGUF adapter's ``general.architecture`` is its base's, as llama.cpp requires
    (llama_adapter_lora_init: its tensor names and row orders are that architecture's)."""
    from loom.model.loader.gguf_configs import LLAMA_CPP_ARCHITECTURES

    expected = LLAMA_CPP_ARCHITECTURES.get(base_architecture)
    if architecture != expected:
        raise AdapterError(
            f"LoRA adapter {path!r} was converted for llama.cpp's {architecture!r} "
            f"architecture; this base ({base_architecture}) is "
            + (f"{expected!r}" if expected else "not one loom serves GGUF adapters on"))


def is_gguf_adapter(path: str) -> bool:
    """``path`` names a file (a GGUF adapter), not a PEFT directory."""
    return os.path.isfile(path)


def parse_lora_modules(values: list[str] | tuple[str, ...] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules name=path ...`` (or vLLM's JSON ``{"name", "path"}``) as pairs."""
    pairs = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
                pairs.append((str(raw["name"]), str(raw["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: give name=path or "
                                 '{"name": ..., "path": ...}') from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: give name=path")
        pairs.append((name, path))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return tuple(pairs)
