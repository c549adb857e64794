"""Speculative decoding: proposers draft tokens, the target verifies them in one pass.

- ``proposer.py``: the ``Proposer`` interface and ``RunnerView``, what a proposer may use of
  the model runner (its model, KV pool shape, and the flat-batch builder).
- ``registry.py``: ``SpeculativeConfig.method`` -> proposer (``build_proposer``).
- ``ngram.py``: prompt lookup over prompt + output, numpy, no model.
- ``draft_model.py``: greedy drafts from a smaller model with its own paged KV cache.
- ``early_exit.py``: self-speculation, the target's first layers with its norm and head.
- ``verify.py``: per-row sampling metadata and the rejection sampler over the drafts
  (the sampler itself is ``sample/rejection_sampler.py``).
"""
