"""Speculative decoding: MTP drafting and the verify acceptance rules."""
