"""Prefill/decode disaggregation (``pd.*`` in the config): the hand-off of a prompt's
checkpoint from a prefill to a decode replica (``handoff``), the ingress's client that
routes each request (``client``) and its one stream over both replicas (``stream``)."""
