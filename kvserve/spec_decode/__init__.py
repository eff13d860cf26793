"""Speculative decoding: proposers guess the next tokens, the target model verifies them all
in one forward pass (kvserve/model/layers/sampler.py: Sampler.verify), so a request can gain
several tokens per step without changing what the target would have produced."""
