"""How many KV blocks an engine holds: what one sequence needs, what the configured
concurrency can fill, and the CPU's default budget. Pure arithmetic on the config; the
workers measure the memory (``Worker.determine_num_blocks``), this decides the count.

    profiled blocks (every rank's MIN) -> cap_num_blocks -> check_num_blocks -> allocate
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.config import EngineConfig


def blocks_per_sequence(config: EngineConfig,
                        kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """The most blocks one sequence of ``max_model_len`` holds at once: in each full
    group one per ``block_size`` positions; in each sliding group of a hybrid cache
    (``kv_cache_groups``: each group's window) its window's and one step's tokens'.
    One group, windowed or not, counts every position (as before groups existed)."""
    block_size = config.cache.block_size
    seq_blocks = -(-config.model.max_model_len // block_size)
    if len(kv_cache_groups) == 1:
        return seq_blocks
    step = config.scheduler.max_num_batched_tokens
    return sum(seq_blocks if window is None
               else min(seq_blocks, (window - 1 + step - 1) // block_size + 2)
               for window in kv_cache_groups)


def cap_num_blocks(config: EngineConfig, num_blocks: int,
                   kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """No more blocks than ``max_num_seqs`` sequences of ``max_model_len`` can fill at once.

    Past that, memory would only keep stale prefix-cache entries, and on CPU every
    block is zeroed and resident. An explicit ``num_gpu_blocks_override`` is kept as is.
    """
    if config.cache.num_gpu_blocks_override is not None:
        return num_blocks
    blocks_per_seq = blocks_per_sequence(config, kv_cache_groups)
    return min(num_blocks, config.scheduler.max_num_seqs * blocks_per_seq)


def check_num_blocks(config: EngineConfig, num_blocks: int, bytes_per_block: int,
                     kv_cache_groups: Sequence[int | None] = (None,)) -> None:
    """Fail at start-up, naming the knobs, if one max_model_len sequence cannot fit."""
    block_size = config.cache.block_size
    needed = blocks_per_sequence(config, kv_cache_groups)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens) "
            f"but one sequence of max_model_len={config.model.max_model_len} needs {needed} "
            f"blocks ({needed * bytes_per_block / 2**20:.1f} MiB); lower --max-model-len or "
            "give the cache more memory (--kv-cache-memory or --memory-utilization)")


# The CPU's default KV cache (no --kv-cache-memory, no --memory-utilization): what the
# configured concurrency can fill, at most this much (vLLM's CPU default is 4 GiB).
# The default model fills it with 23,000 tokens, and `loom serve` stays under 2 GiB.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def lean_cpu_kv_cache_bytes(config: EngineConfig, bytes_per_block: int,
                            kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """The CPU's default KV budget: ``max_num_seqs`` sequences of ``max_model_len``, at
    most DEFAULT_CPU_KV_CACHE_BYTES, at least one sequence of max_model_len.

        SmolLM2-135M, bf16: 22.5 KiB a token; 64 x 4,096 tokens would be 5.6 GiB,
        capped to 0.5 GiB = 23,296 tokens = 5.7 sequences of 4,096
    """
    blocks_per_seq = blocks_per_sequence(config, kv_cache_groups)
    wanted = config.scheduler.max_num_seqs * blocks_per_seq * bytes_per_block
    return max(min(wanted, DEFAULT_CPU_KV_CACHE_BYTES), blocks_per_seq * bytes_per_block)


def kv_cache_summary(config: EngineConfig, num_blocks: int, bytes_per_block: int,
                     kv_cache_groups: Sequence[int | None] = (None,)) -> str:
    """One line for the start-up log: size, the cache's dtype, tokens, and how many
    max_model_len requests fit at once (as vLLM's "Maximum concurrency" line). A hybrid cache's
    blocks are shared by its groups: tokens counted as one sequence holds them."""
    max_model_len = config.model.max_model_len
    if bytes_per_block == 0:
        return (f"no KV cache (an encoder: each prompt runs whole in one step); "
                f"{num_blocks:,} blocks of {config.cache.block_size} count the scheduler's "
                "tokens")
    concurrency = num_blocks / blocks_per_sequence(config, kv_cache_groups)
    groups = (f" in {len(kv_cache_groups)} groups ({kv_cache_groups.count(None)} of full "
              f"attention)" if len(kv_cache_groups) > 1 else "")
    tokens = (num_blocks * config.cache.block_size if not groups
              else int(concurrency * max_model_len))
    dtype = config.cache.kv_cache_dtype
    dtype = config.model.dtype if dtype == "auto" else dtype
    return (f"KV cache {num_blocks * bytes_per_block / 2**30:.2f} GiB in {dtype}, {tokens:,} tokens "
            f"({num_blocks:,} blocks of {config.cache.block_size}{groups}); maximum concurrency "
            f"for {max_model_len:,} tokens per request: {concurrency:.2f}x")
