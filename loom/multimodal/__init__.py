"""Multimodal inputs: the images a request refers to, from reference to model input."""
