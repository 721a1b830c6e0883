"""Structured outputs: grammar-constrained decoding with llguidance.

    API / input side   grammar.validate()           spec -> llguidance grammar, checked (a 400)
    engine core        StructuredOutputManager      compiles off the step path (a thread, a
                                                    cache keyed by spec), owns each request's
                                                    matcher, builds the step's token bitmask
    worker             bitmask.apply_grammar_bitmask  -inf on disallowed tokens before sampling

Nothing here imports torch except ``bitmask`` (worker side only).
"""

from loom.structured_output.grammar import GrammarError, build_grammar, validate_structured_outputs
from loom.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["GrammarError", "StructuredOutputManager", "StructuredOutputRequest", "build_grammar",
           "validate_structured_outputs"]
