"""Expert parallel in worker processes: LLM(tensor_parallel_size=2,
enable_expert_parallel=True) splits each MoE layer's experts over the two ranks and
gives the greedy tokens of one rank and of transformers, with a router biased toward
two experts (both on rank 0), chunked prefill and prefix caching on."""

from __future__ import annotations

import pytest

from checkpoints import MOE_FAMILIES, bias_router

from .helpers import make_model_dir
from .test_tensor_parallel import loom_greedy, transformers_greedy


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep2_matches_one_rank_and_transformers(tmp_path, family):
    path = bias_router(make_model_dir(family, tmp_path / family))
    expected = transformers_greedy(path)
    one_cold, _, _ = loom_greedy(path)
    ep_cold, ep_warm, cached = loom_greedy(path, tensor_parallel_size=2,
                                           enable_expert_parallel=True)
    assert one_cold == expected
    assert ep_cold == expected
    assert ep_warm == expected
    assert cached[0] >= 32
