"""Scenarios for tests/multirank/test_score_multirank.py (inside gloo ranks of a World), and the
teacher-forced reference that tests/unit/test_score.py shares: one unpadded single-process HF forward
per row."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from models import tiny_model

HINT = [11, 12, 13]  # a teacher's privileged context, before the student's prompt


def reference_row(
    logits: torch.Tensor, response: list[int], temperature: float, top_k: int
) -> dict[str, Any]:
    """One row's reference from HF's ``logits`` at its response positions: the response's logprobs,
    the entropy, the log softmax (``all``), the top-k logprobs when asked."""
    lp = torch.log_softmax(logits.float() / temperature, -1)
    row = {"logprobs": lp.gather(-1, torch.tensor(response, dtype=torch.long)[:, None]).squeeze(-1)}
    row["entropy"] = -(lp.exp() * lp).sum(-1)
    row["logits"], row["all"] = logits, lp
    if top_k:
        row["top_logprobs"] = lp.topk(top_k, -1).values
    return row


def reference(model, prompts, responses, temperature: float = 1.0, top_k: int = 0) -> list[dict[str, Any]]:
    """Per row: HF ``model(input_ids).logits`` on prompt + response, log softmax at the response."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([list(p) + list(r)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
        out.append(reference_row(logits, r, temperature, top_k))
    return out


def worst(sb, ref: list[dict[str, Any]], top_k: int = 0) -> float:
    """The largest difference between a ScoreBatch and the reference rows (masks checked exactly)."""
    diff = 0.0
    for i, want in enumerate(ref):
        g = int(want["logprobs"].shape[0])
        assert sb.mask[i].tolist() == [1] * g + [0] * (sb.mask.shape[1] - g), f"row {i}: mask"
        assert torch.all(sb.logprobs[i, g:] == 0), f"row {i}: logprobs past its length"
        diff = max(diff, (sb.logprobs[i, :g] - want["logprobs"]).abs().max().item() if g else 0.0)
        if sb.entropy is not None and g:
            diff = max(diff, (sb.entropy[i, :g] - want["entropy"]).abs().max().item())
        if top_k and g:
            diff = max(diff, (sb.top_logprobs[i, :g] - want["top_logprobs"]).abs().max().item())
            # the ids the engine chose carry (within rounding) the logprobs it reports for them
            theirs = want["all"].gather(-1, sb.top_ids[i, :g])
            diff = max(diff, (theirs - sb.top_logprobs[i, :g]).abs().max().item())
        if sb.logits is not None and g:
            diff = max(diff, (sb.logits[i, :g].float() - want["logits"].float()).abs().max().item())
    return diff


def rows_for(
    rank: int, count: int, seed: int, shared: bool = True
) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` rows of random ids; with ``shared``, rows in pairs with one prompt (n = 2)."""
    g = torch.Generator().manual_seed(1000 * rank + seed)
    prompts, responses = [], []
    for i in range(count):
        if shared and i % 2 == 1:
            p = prompts[-1]
        else:
            p = torch.randint(3, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        prompts.append(p)
        responses.append(
            torch.randint(3, 90, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        )
    return prompts, responses


def _pair(arch: str = "llama", seed: int = 7, **over):
    model, ref = tiny_model(arch, seed=seed, **over), tiny_model(arch, seed=seed, **over)
    ref.load_state_dict(model.state_dict())
    return model, ref


def score_uneven(
    backend: str, gather: str, max_prefill_tokens: int | None, arch: str = "llama", **over: Any
) -> dict[str, Any]:
    """Rows per rank uneven: rank 0 scores 5 rows (shared prompts) and then 3 at T = 0.7 with top-k,
    rank 1 none (``score([], [])``) while it generates, rank 2 (3 ranks) 2 rows from a second thread
    beside its own generate(). -> {"diff": the worst difference from HF, "policy", "gen": tokens}."""
    import shardgen

    rank = dist.get_rank()
    model, ref = _pair(arch, **over)
    res: dict[str, Any] = {"diff": 0.0}
    opts = dict(backend=backend, gather=gather, max_prefill_tokens=max_prefill_tokens, max_batch_size=4)
    with shardgen.Engine(model, **opts) as eng:
        res["policy"] = eng.gather_policy
        if rank == 0:
            p, r = rows_for(rank, 5, 1)
            sb = eng.score(p, r, logits=True)
            res["diff"] = max(res["diff"], worst(sb, reference(ref, p, r)))
            p, r = rows_for(rank, 3, 2, shared=False)
            sb = eng.score(p, r, temperature=0.7, top_k=4)
            res["diff"] = max(res["diff"], worst(sb, reference(ref, p, r, 0.7, 4), top_k=4))
        elif rank == 1:
            empty = eng.score([], [])
            assert len(empty) == 0 and tuple(empty.logprobs.shape) == (0, 0)
            res["gen"] = len(eng.generate([[5, 6, 7, 8]], max_new_tokens=12, eos_token_id=[])[0].token_ids)
        else:
            p, r = rows_for(rank, 2, 3)
            box: dict[str, Any] = {}
            t = threading.Thread(target=lambda: box.update(sb=eng.score(p, r)))
            t.start()
            res["gen"] = len(eng.generate([[9, 10, 11]], max_new_tokens=6, eos_token_id=[])[0].token_ids)
            t.join(60)
            res["diff"] = worst(box["sb"], reference(ref, p, r))
    return res


def rescore_rollout(backend: str) -> dict[str, Any]:
    """Rank 0 rolls out 2 prompts x n = 3 and rank 1 one x 3; each scores its batch (equal to the
    rollout's own logprobs) and rescores its responses under teacher prompts (HINT + prompt)."""
    import shardgen

    rank = dist.get_rank()
    model, ref = _pair()
    prompts = [[5, 6, 7, 8], [20, 21, 22]] if rank == 0 else [[30, 31, 32, 33, 34]]
    with shardgen.Engine(model, backend=backend) as eng:
        b = eng.rollout(prompts, n=3, seed=rank, max_new_tokens=8, eos_token_id=list(range(2, 10)))
        own = eng.score(b)
        teacher = [HINT + p for p in prompts for _ in range(3)]
        lengths = b.response_lengths.tolist()
        responses = [b.response_ids[i, : int(g)].tolist() for i, g in enumerate(lengths)]
        sb = eng.score(b, prompts=teacher)
    self_diff = (own.logprobs - b.logprobs).abs().max().item()
    return {"self": self_diff, "teacher": worst(sb, reference(ref, teacher, responses)), "rows": len(b)}


def two_engines(backend: str) -> dict[str, Any]:
    """A student (llama) and a teacher (qwen2) sharded on the same ranks, open together, used
    non-collectively: rank 0 scores on the teacher while rank 1 still generates on the student,
    then the other way round; each closed collectively (the teacher first)."""
    import shardgen

    rank = dist.get_rank()
    student, s_ref = _pair("llama", seed=7)
    teacher, t_ref = _pair("qwen2", seed=8)
    s_eng = shardgen.Engine(student, backend=backend)
    t_eng = shardgen.Engine(teacher, backend=backend)
    p, r = rows_for(rank, 4, 5)
    res: dict[str, Any] = {}
    if rank == 0:
        res["diff"] = worst(t_eng.score(p, r), reference(t_ref, p, r))
        res["gen"] = s_eng.generate([[4, 5, 6]], max_new_tokens=5, eos_token_id=None)[0].token_ids
    else:
        res["gen"] = s_eng.generate([[4, 5, 6]], max_new_tokens=20, eos_token_id=None)[0].token_ids
        res["diff"] = worst(t_eng.score(p, r), reference(t_ref, p, r))
    with torch.no_grad():
        want = s_ref.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=len(res["gen"]), do_sample=False)
    res["gen_ok"] = want[0, 3:].tolist() == res["gen"]
    t_eng.close()
    res["student_after"] = len(s_eng.score(p, r))  # the student still works with the teacher closed
    s_eng.close()
    res["groups"] = (s_eng._prefix, t_eng._prefix)
    return res
