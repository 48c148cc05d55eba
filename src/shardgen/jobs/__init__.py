"""``shardgen run`` on each rank: prompts files (``prompts``), claims and the serving loop
(``run``), durable per-rank journals (``journal``), the progress bar and summary (``progress``)."""
