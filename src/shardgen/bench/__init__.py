"""``shardgen bench``: every generation method side by side (``command``, ``methods``) and the
per-rank timeline PNGs (``plot``)."""
