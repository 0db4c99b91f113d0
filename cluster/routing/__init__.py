"""Choosing a replica: the Serve request router (``router``), its pure policy
(``routing_policy``), and the per-replica checkpoint prefix index (``prefix_index``)
held by the router index actor (``router_actor``)."""
