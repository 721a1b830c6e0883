"""Vision towers of multimodal families: pixels in, the language model's embeddings out.

Each tower takes what its checkpoint's own ``transformers`` image processor made
(``pixel_values`` and, where the family has one, ``image_grid_thw``) and returns one row
per placeholder token the prompt holds for those images, in the language model's hidden
size. The family's model class (``loom/model/models``) owns the tower, loads its weights
and puts its rows in place of the placeholder tokens' embeddings.
"""
