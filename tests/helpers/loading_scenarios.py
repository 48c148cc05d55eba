"""Scenarios for tests/multirank/test_loading.py; they run inside gloo ranks of a World."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from models import batch, hf_generate, tiny_config

import shardgen


def write_checkpoint(
    path: str,
    *,
    tied: bool,
    shards: bool,
    big: bool = False,
    vocab: int | None = None,
    pickled: bool = False,
) -> str:
    """A Llama checkpoint from a config in code. ``big`` (memory tests): ~340 MB of fp32, 40 layers
    of 3.0 MiB (bf16) and a 32000-row vocabulary, so the embeddings and the head (23 MiB each in
    bf16) are each bigger than two decoder layers, as in Llama-3-8B. ``pickled``: a
    ``pytorch_model.bin`` instead of safetensors files (transformers 5 writes safetensors
    whatever ``safe_serialization`` says, so the weights are re-saved with ``torch.save``)."""
    from transformers import AutoModelForCausalLM

    over: dict = dict(tie_word_embeddings=tied)
    if vocab is not None:
        over["vocab_size"] = vocab
    if big:
        over.update(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=40,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
        )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **over))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path, max_shard_size="20MB" if big else ("30KB" if shards else "5GB"))
    if pickled:
        assert not shards
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
        os.remove(os.path.join(path, "model.safetensors"))
    return path


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def _oracle(path: str, dtype: str, ids, mask, new: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype) if dtype != "auto" else "auto"
    )
    return hf_generate(ref.eval(), ids, mask, max_new_tokens=new)


def reset_peak() -> float:
    """Reset VmHWM to the current resident size (Linux ``clear_refs``); return it in MB.

    First what an earlier scenario or engine in this process left is freed (``gc.collect``:
    engines and models in reference cycles would otherwise be freed during the measurement)
    and the free heap memory goes back to the OS (``malloc_trim``): resident already, it would
    be reused without raising the peak."""
    import gc

    from shardgen.backends.buffer_pool import trim_heap

    gc.collect()
    trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return vm_hwm_mb()


def scenario_load_and_generate(
    path: str,
    backend: str,
    dtype: str = "auto",
    new: int = 5,
    warm_path: str | None = None,
    **options,
) -> dict:
    """Engine.from_pretrained on ``path``; VmHWM growth while loading and generating; equal to HF?

    Every rank runs it. With ``warm_path``, an engine on that (tiny) checkpoint first loads,
    generates and closes, so imports and engine machinery are in the baseline; the peak is
    then reset (after returning free heap memory to the OS, so that nothing freed earlier in
    the process is reused unseen), and VmHWM minus the baseline is what loading and
    generating ``path`` cost. ``options``: engine options (e.g. ``chunk_mb``).
    """
    if warm_path is not None:
        ids, mask = batch([3], seed=0)
        with shardgen.Engine.from_pretrained(
            warm_path, backend=backend, dtype=dtype, gather="per-layer"
        ) as warm:
            warm.generate_ids(ids, mask, max_new_tokens=1)
    base = reset_peak()
    engine = shardgen.Engine.from_pretrained(
        path, backend=backend, dtype=dtype, max_batch_size=4, **options, gather="per-layer"
    )
    loaded = vm_hwm_mb() - base
    ids, mask = batch([6, 3, 5], seed=dist.get_rank())
    try:
        out = engine.generate_ids(ids, mask, max_new_tokens=new)
        generated = vm_hwm_mb() - base
        tied = engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
        dtypes = {str(p.dtype) for p in engine.model.parameters()}
        chunked = getattr(engine.backend, "chunked", None)
        chunks = chunked.describe() if chunked is not None else {}
    finally:
        engine.close()
    ref = _oracle(path, dtype, ids, mask, new)
    return dict(
        load_mb=loaded,
        gen_mb=generated,
        equal=bool(torch.equal(out, ref)),
        tied=tied,
        dtypes=dtypes,
        chunks=chunks,
        pid=os.getpid(),
    )


def _process_state() -> dict:
    """What a load must leave as it found it: the default dtype and device, the tensor
    constructors and ``nn.Module`` methods ``zero.Init`` patches, ``F.linear``, DeepSpeed's
    ``zero.Init`` nesting."""
    import sys

    import torch.nn.functional as F
    from torch import nn

    state = {"default dtype": torch.get_default_dtype(), "default device": torch.get_default_device()}
    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn"):
        state[f"torch.{name}"] = getattr(torch, name)
    state["Tensor.__new__"] = torch.Tensor.__new__
    state["Module.apply"] = nn.Module.apply
    state["Module.__init_subclass__"] = nn.Module.__init_subclass__
    state["F.linear"] = F.linear
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if pp is not None:
        state["zero_init_context"] = pp.zero_init_context
        state["top_level_context"] = pp.top_level_context
    return state


def scenario_dtype_sequence(path: str, backend: str, dtypes: list[str], fp16_supported: bool | None = None):
    """``Engine.from_pretrained(path, dtype=d)`` for each ``d`` in turn, in this process: per load,
    ``(d, parameter dtypes, shard dtypes, process-wide state the load changed)``.

    ``fp16_supported``: what DeepSpeed's accelerator answers to ``is_fp16_supported()`` meanwhile
    (a CPU without AVX512-FP16 / AMX-FP16 answers False); None leaves its real answer.
    """
    acc = None
    if fp16_supported is not None:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        acc.is_fp16_supported = lambda: fp16_supported  # instance attribute: deleted below
    out = []
    try:
        for dtype in dtypes:
            before = _process_state()
            with shardgen.Engine.from_pretrained(
                path, backend=backend, dtype=dtype, gather="per-layer"
            ) as engine:
                params = list(engine.model.parameters())
                dtypes_seen = sorted({str(p.dtype) for p in params})
                shards = sorted(
                    {
                        str(p.ds_tensor.dtype if hasattr(p, "ds_tensor") else p.to_local().dtype)
                        for p in params
                    }
                )
            after = _process_state()
            changed = sorted(k for k in before if k not in after or after[k] != before[k])
            out.append((dtype, dtypes_seen, shards, changed))
    finally:
        if acc is not None:
            del acc.is_fp16_supported
    return out


def scenario_write(path: str, **kw) -> None:
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        write_checkpoint(path, **kw)
    dist.barrier()


def scenario_hf_zero3(path: str, offload: bool, new: int = 5) -> bool:
    """The seed's loading path: ``HfDeepSpeedConfig(ds_config)`` then ``from_pretrained``, into the engine.

    transformers builds the model under ``zero.Init`` on the default group (partitioned at load);
    the deepspeed backend moves its traffic to the private group. Equal to HF generate()?
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    zero: dict = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    ds_config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}
    dschf = HfDeepSpeedConfig(ds_config)  # must stay alive while from_pretrained runs
    try:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    finally:
        del dschf
        unset_hf_deepspeed_config()
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "not partitioned at load"
    ids, mask = batch([6, 3, 5], seed=dist.get_rank())
    with shardgen.Engine(model, backend="deepspeed", max_batch_size=4, gather="per-layer") as engine:
        out = engine.generate_ids(ids, mask, max_new_tokens=new)
    return bool(torch.equal(out, _oracle(path, "auto", ids, mask, new)))
