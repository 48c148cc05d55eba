"""Generation on one rank, with no ``torch.distributed``: prefill/decode and the KV cache
(``decode``), sampling, requests and their results, the per-rank scheduler, ``rollout()``."""
