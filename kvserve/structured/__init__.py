"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar
against the model's vocabulary, and the per-request matcher that masks logits each step.

spec.py parses a request's StructuredOutputsParams into an xgrammar Grammar (also used by
the API side to refuse invalid schemas with a 400); backend.py compiles grammars off the
step loop with a cache; state.py is one request's matcher; bitmask.py applies the masks of
a step's constrained rows to the logits in one call.
"""
