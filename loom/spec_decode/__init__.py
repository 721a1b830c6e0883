"""Speculative decoding: proposers that draft tokens, and the rejection sampler that
verifies them (docs/speculative_decoding.md)."""
