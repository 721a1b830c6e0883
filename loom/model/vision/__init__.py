"""Vision towers of multimodal families: pixels in, the language model's embeddings out.

Each tower takes what its checkpoint's own ``transformers`` image processor made
(``pixel_values`` and, where the family has one, ``image_grid_thw``) and returns one row
per placeholder token the prompt holds for those images, in the language model's hidden
size. The family's model class (``loom/model/models``) owns the tower, loads its weights
and puts its rows in place of the placeholder tokens' embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn


def tower_weights_on_the_way(weights: Iterable[tuple[str, torch.Tensor]],
                             route: Callable[[str], tuple[bool, str]], tower: nn.Module,
                             loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors, yielded as the checkpoint gives them, while each of
    the tower's is loaded into ``tower`` as it arrives (its names added to ``loaded``).
    ``route(name)`` is (to the tower?, the name there). No tensor is held past its own
    load, so reading a multimodal checkpoint peaks at the model plus one tensor, not
    twice the weights. The caller's language loader must consume the whole stream."""
    for name, tensor in weights:
        to_tower, ours = route(name)
        if to_tower:
            loaded.update(tower.load_weights([(ours, tensor)]))
        else:
            yield ours, tensor
