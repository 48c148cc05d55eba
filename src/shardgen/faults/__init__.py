"""When a rank is gone: heartbeats (``liveness``), the first-writer-wins verdict that names the
culprit (``verdict``), and drivers that stopped moving (``stalls``)."""
