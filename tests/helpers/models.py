"""Tiny models built from configs in code (never downloaded), shared by all tests."""

from __future__ import annotations

import hashlib
import os
import sys
import threading

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Qwen2Config,
)

VOCAB = 96


def tiny_config(arch: str, **over):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    decoder = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
    gqa = dict(decoder, num_key_value_heads=2)
    if arch == "llama":
        cfg = LlamaConfig(intermediate_size=64, **gqa, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(intermediate_size=64, **gqa, **common)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
    elif arch == "opt":
        cfg = OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **decoder, **common)
    elif arch == "gemma":  # a scaled-embedding subclass of nn.Embedding, tied to the head by default
        cfg = GemmaConfig(intermediate_size=64, head_dim=8, **gqa, **common)
    elif arch == "mistral":  # a sliding window shorter than the test prompts: sliding cache layers
        cfg = MistralConfig(intermediate_size=64, sliding_window=8, **gqa, **common)
    elif arch == "mixtral":
        cfg = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **gqa, **common)
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, **over):
    """The same weights for the same (arch, seed) in every process."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model.eval()


def batch(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch (pad id 0) of random prompts with the given lengths -> (ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def hf_generate(model, ids, mask, **kw) -> torch.Tensor:
    """The oracle: single-process HF generate (synced_gpus off, or it would deadlock in a world).

    Kept in the run's oracle cache (``ORACLE_DIR``, below) under everything its output depends
    on, so the ranks of a world and the backend and gather cases of one scenario compute each
    answer once per ``make test``."""
    path = _oracle_path(model, ids, mask, kw)
    if path is not None and os.path.exists(path):
        return torch.load(path)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, synced_gpus=False, **kw)
    if path is not None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        torch.save(out, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return out


# The folder of the run's oracle cache, from the test session (tests/conftest.py); unset: no cache.
ORACLE_DIR = "SHARDGEN_TEST_ORACLE_DIR"
_PLAIN = (int, float, str, bool, type(None))


def _oracle_path(model, ids, mask, kw: dict) -> str | None:
    """The cache file of this call: a hash of the model's class, config, generation config and
    weights, the inputs and keywords, and the numerics in force (the small-row switch, invariant
    numerics, the default dtype); None where a keyword is not a plain value (a logits processor,
    a streamer) or no cache folder is set."""
    folder = os.environ.get(ORACLE_DIR)
    if not folder or not all(isinstance(v, _PLAIN) or _plain_seq(v) for v in kw.values()):
        return None
    import rounding

    mode = sys.modules.get("shardgen.numerics.mode")
    numerics = (rounding.installed(), mode is not None and mode.active(), torch.get_default_dtype())
    h = hashlib.sha256()
    try:
        for part in (
            type(model).__qualname__,
            model.config.to_json_string(use_diff=False),
            model.generation_config.to_json_string(use_diff=False),
            repr((sorted(kw.items()), model.training, numerics)),
        ):
            h.update(part.encode())
        for name, t in [*model.named_parameters(), *model.named_buffers(), ("ids", ids), ("mask", mask)]:
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                return None  # a sharded (DTensor) or otherwise wrapped weight: computed, not kept
            t = t.detach()
            h.update(f"{name}{tuple(t.shape)}{t.dtype}{t.device}".encode())
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    except (TypeError, ValueError, RuntimeError):  # a config or tensor that does not serialize
        return None
    return os.path.join(folder, h.hexdigest() + ".pt")


def _plain_seq(v) -> bool:
    return type(v) in (list, tuple) and all(isinstance(x, _PLAIN) for x in v)


def eos_after(model, ids, mask, row: int, step: int, **kw) -> int:
    """An EOS id that makes ``row`` stop after ``step`` tokens: what greedy generates there."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # HF merges a None argument with the model's EOS
    try:
        out = hf_generate(model, ids, mask, max_new_tokens=step + 1, **kw)
    finally:
        model.generation_config.eos_token_id = saved
    return int(out[row, ids.shape[1] + step])


def chunked_against_own_fill(backend, ref, dtype: torch.dtype = torch.float32) -> dict:
    """A backend's ``gather_all`` in chunks (``backends/whole.py``) against its own gathers
    (``_whole = False``: as for a layout the chunks do not cover), and both against ``ref``'s
    values in ``dtype``; the backend is closed. Collective on its param group (two gathers)."""
    backend.gather_all()
    chunks = len(backend._whole) if backend._whole else 0
    whole = {n: p.detach().clone() for n, p in backend.replica.module.named_parameters()}
    backend.release_all()
    backend._whole = False
    backend.gather_all()
    own = {n: p.detach().clone() for n, p in backend.replica.module.named_parameters()}
    rep = backend.replica.module
    tied = rep.get_output_embeddings().weight is rep.get_input_embeddings().weight
    backend.release_all()
    backend.close()
    full = dict(ref.named_parameters())
    return {
        "chunks": chunks,
        "names": sorted(whole) == sorted(own) == sorted(full),
        "equal_own": [n for n in whole if not torch.equal(whole[n], own[n])],
        "equal_full": [n for n in whole if not torch.equal(whole[n], full[n].detach().to(dtype))],
        "dtypes": sorted({str(t.dtype) for t in whole.values()}),
        "tied": tied,
    }
