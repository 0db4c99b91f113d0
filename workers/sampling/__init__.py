"""Batched sampling: logits processors, penalty registers, grammar bitmasks, prompt logprobs.

Nothing is re-exported here: ``workers.sampling_params`` imports ``structured`` and the
other modules import ``sampling_params``, so a package ``__init__`` that imported both
would be an import circle.
"""
