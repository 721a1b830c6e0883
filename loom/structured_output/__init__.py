"""Structured outputs: grammar-constrained decoding with llguidance or xgrammar.

    API / input side   grammar.validate_structured_outputs()  checked by the backend that
                                                    serves the request (a 400)
    which backend      constraint.backend_for()     --structured-outputs-backend; auto:
                                                    xgrammar unless the request needs what
                                                    it does not enforce, then llguidance
    engine core        StructuredOutputManager      compiles off the step path (a thread, a
                                                    cache keyed by backend and spec), owns
                                                    each request's matcher of either backend,
                                                    builds the step's token bitmask
    worker             bitmask.apply_grammar_bitmask  -inf on disallowed tokens before sampling

llguidance: grammar.py; xgrammar: xgrammar_backend.py (imported only where a request is
served or checked by xgrammar: it imports torch). Nothing else here imports torch
except ``bitmask`` (worker side only).
"""

from loom.structured_output.constraint import GrammarError, backend_for
from loom.structured_output.grammar import build_grammar, validate_structured_outputs
from loom.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["GrammarError", "StructuredOutputManager", "StructuredOutputRequest", "backend_for",
           "build_grammar", "validate_structured_outputs"]
