"""Speculative decoding: proposers of draft tokens (the rejection sampler is in sample/)."""
