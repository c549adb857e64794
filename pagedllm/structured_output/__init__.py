"""Structured outputs: xgrammar grammars that constrain sampling (JSON schema, JSON object,
regex, choice, EBNF).

- ``grammar.py``: a StructuredOutputsParams -> an xgrammar grammar; ``validate`` (no tokenizer,
  for the front end) and ``compile_spec`` (with the engine's tokenizer vocabulary).
- ``manager.py``: StructuredOutputManager, owned by the engine core: compiles off the step
  loop, caches compiled grammars by spec, keeps one matcher per sequence, fills each step's
  token bitmask (under speculative decoding, a row per verified position) and advances the
  matchers with the sampled tokens.
- ``bitmask.py``: GrammarBitmask (plain data in SchedulerOutput) and the runner's in-place
  masking of logits.

xgrammar (and torch) load on the first constrained request, never at import of this package.
"""

from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.structured_output.grammar import validate

__all__ = ["GrammarBitmask", "validate"]
