"""The cluster-wide checkpoint store (DESIGN §8): its index and budget as a plain class
(``checkpoint_store``), the replica's fetch / commit logic (``client``, Ray-free), and the
Ray edge: the named detached actor holding the entries' ObjectRefs (``actor``)."""
