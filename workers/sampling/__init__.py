"""Batched sampling: logits processors, penalty registers, grammar bitmasks, prompt logprobs.

The request's parameters (``params``: ``SamplingParams``) and the sampler that draws from
the processed logits (``sampler``) live here too. Nothing is re-exported: ``params``
imports ``structured`` and the other modules import ``params``, so a package ``__init__``
that imported both would be an import circle.
"""
