"""EngineCoreClient: the API process's end of a real engine core process (tiny model):
ready, a request's outputs, a clean stop; what a stalled core sent is handed back and
the core killed; a core that cannot load fails start()."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil

import pytest

from checkpoints import make_tiny_checkpoint
from loom.config import EngineConfig
from loom.engine_args import make_engine_config
from loom.core.wire import EngineCoreOutputs, EngineCoreRequest
from loom.ipc.engine_core_client import EngineCoreClient
from loom.sampling_params import SamplingParams
from tokenizer_fixtures import make_tiny_tokenizer


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    tokenizer_dir = os.path.join(path, "_tokenizer")
    make_tiny_tokenizer(tokenizer_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return make_engine_config(path, max_model_len=64, dtype="float32",
                              num_gpu_blocks_override=16, enable_warm_up=False)


def request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=[], arrival_time=0.0, parent_request_id=request_id)


def test_a_request_round_trip_then_shutdown(config):
    async def run() -> list[int]:
        client = EngineCoreClient(config)
        assert await client.start() == 16
        socket_dir = client.input_address.removeprefix("ipc://").rsplit("/", 1)[0]
        client.send(request("a", max_tokens=3))
        tokens: list[int] = []
        while True:
            message = await asyncio.wait_for(client.receive(), 30)
            assert isinstance(message, EngineCoreOutputs), message
            [output] = message.outputs or [None]
            if output is not None:
                tokens += output.new_token_ids
                if output.finished:
                    break
        await client.shutdown(timeout=10)
        assert client.exitcode == 0
        assert not os.path.exists(socket_dir)
        return tokens

    assert len(asyncio.run(run())) == 3


def test_what_a_stalled_core_sent_is_handed_back_then_it_is_killed(config, monkeypatch, capfd):
    monkeypatch.setenv("LOOM_TEST_STALL_ENGINE_AT_STEP", "3")  # read by the spawned core

    async def run() -> list:
        client = EngineCoreClient(config)
        await client.start()
        client.send(request("a", max_tokens=8))
        remaining = await client.receive_remaining(timeout_ms=5000)  # steps 1 and 2
        await client.kill()
        assert not client.is_alive()
        await client.shutdown(timeout=1)
        return remaining

    remaining = asyncio.run(run())
    assert [type(m) for m in remaining] == [EngineCoreOutputs, EngineCoreOutputs]
    assert [len(m.outputs[0].new_token_ids) for m in remaining] == [1, 1]
    assert "stalling before step 3" in capfd.readouterr().err


def test_a_core_that_cannot_load_raises_at_start(config):
    # Past from_args' up-front checks: the core's executor finds the cache too small.
    broken = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                   num_gpu_blocks_override=1))

    async def run() -> None:
        client = EngineCoreClient(broken)
        try:
            await client.start()
        finally:
            await client.shutdown(timeout=1)

    with pytest.raises(RuntimeError, match="max_model_len"):
        asyncio.run(run())
