"""Checkpoints straight into shards: the ``from_pretrained`` skeleton and the fsdp2 reads
(``pretrained``), DeepSpeed's flat partitions (``deepspeed``), byte-range safetensors reads
(``checkpoint``), and the memory estimates of ``gather="auto"`` (``memory``)."""
