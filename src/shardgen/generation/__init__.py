"""Generation on one rank, with no ``torch.distributed``: a batch's prefill and decode steps
(``batch``) and its KV cache (``cache``), sampling, requests and their results, the per-rank
scheduler, ``rollout()``."""
