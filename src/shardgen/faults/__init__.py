"""When a rank is gone: heartbeats (``liveness``), the first-writer-wins verdict that names the
culprit (``verdict``), drivers that stopped moving (``stalls``), a rank that leaves with an
exception (``leaving``), the rank a failure or a wait that ran out is blamed on (``blame``), and
the store barrier that ends a pause (``resume``)."""
