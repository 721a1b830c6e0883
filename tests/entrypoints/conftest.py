from __future__ import annotations

import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer, make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def start_server(tiny_model_dir):
    """Start ``loom serve`` on the tiny model with extra flags (and environment); every
    server started is killed at the end of the test."""
    servers = []

    def start(*args: str, env: dict[str, str] | None = None) -> LoomServer:
        servers.append(LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, *args, env=env))
        return servers[-1]

    yield start
    for server in servers:
        server.kill()
