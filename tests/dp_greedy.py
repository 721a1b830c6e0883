"""Greedy tokens through a started ``DPAsyncLLM``, as the expert-parallel-across-replicas
tests compare them: each prompt alone, one after another (so one replica is busy and
the other steps in dummy exchanges), then all at once."""

from __future__ import annotations

import asyncio


async def one_then_all(llm, prompts: list[list[int]], params,
                       tag: str = "") -> tuple[list, list, list]:
    """(tokens one request at a time, tokens all at once, the replica each request of
    the first pass went to); ``tag`` prefixes the request ids."""

    async def run(request_id: str, prompt: list[int], replicas: list[int]) -> list[int]:
        stream = llm.add_request(request_id, None, prompt, params, stream=False)
        replicas.append(llm.replica_of(request_id))
        async for output in stream:
            last = output
        return list(last.outputs[0].token_ids)

    replicas: list[int] = []
    one_at_a_time = [await run(f"{tag}one-{i}", p, replicas) for i, p in enumerate(prompts)]
    all_at_once = await asyncio.gather(*(run(f"{tag}all-{i}", p, []) for i, p in enumerate(prompts)))
    return one_at_a_time, list(all_at_once), replicas
