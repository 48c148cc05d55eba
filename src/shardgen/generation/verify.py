"""The verify forward of speculative decoding: one decode forward where row i feeds its last token
and its draft (``drafts[i]``, k_i tokens), every row at the width K + 1 of the longest draft, the
LM head on every position; then each row keeps what the plain engine would have drawn.

Acceptance walks a row's positions in order and draws each position's token exactly as the
plain engine's step would draw it there (``select_tokens`` with the row's own generator: one
draw per committed token, as in plain decoding; greedy rows take the argmax), commits it through
``SeqState.append`` (so EOS, a stop string and ``max_new_tokens`` end the row exactly where one
token at a time would, and a partial rollout's row stops at its budget, where it parks after the
forward as after a plain step), and goes on while the token equals the draft's. The first token that
differs (or the one after a wholly accepted draft) is the last committed. A row's tokens are
then the plain engine's whenever its logits at each position are the one-token step's: always
the same bits under ``numerics="invariant"`` (its attention takes each row's visible keys in
order, whatever the columns between them), up to the last bits of the kernels otherwise.

The columns of rejected positions stay in the cache as holes: attention mask 0 (no later query
sees them), ``position_ids`` counting the kept tokens only, as left padding is. Columns that are
holes in every row are cropped off the cache at once. No ``torch.distributed``: ``forward`` is
the backend's, bound to the tick's ``VERIFY`` plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.generation.drafts import tokens_left
from shardgen.generation.sampling import chosen_logprobs, select_tokens


@dataclass(frozen=True)
class Verified:
    """What one verify forward did: draft tokens fed, those accepted, tokens committed per row."""

    drafted: int
    accepted: list[int]
    committed: list[int]


def verify_step(batch: Any, forward: Callable[..., Any], drafts: tuple[tuple[int, ...], ...]) -> Verified:
    """ONE forward of ``batch`` (a prefilled ``Batch`` of plain cache layers) feeding each row's
    last token and ``drafts[i]``; commits each row's tokens as described in the module docstring."""
    seqs = batch.seqs
    B = len(seqs)
    assert len(drafts) == B, f"{len(drafts)} drafts for {B} rows"
    K = max(len(d) for d in drafts)
    assert K > 0, "a verify forward with no draft"
    W = K + 1
    ids_d, fed, pos_d = draft_columns(batch, drafts)
    mask = torch.cat([batch._full_mask(), fed], dim=-1)
    ids = torch.cat([batch.input_ids, ids_d], dim=-1)
    kw: dict[str, Any] = {batch._cache_kw: batch.cache, "use_cache": True, "attention_mask": mask}
    if batch._takes_positions:
        kw["position_ids"] = torch.cat([batch.position_ids, pos_d], dim=-1)
    if batch._takes_logits_to_keep:
        kw["logits_to_keep"] = W
    inputs = batch.hf_model.prepare_inputs_for_generation(ids, next_sequence_length=W, **kw)
    logits = batch.last_logits(forward(**inputs, return_dict=True), W)  # [B, W, V]
    return settle(batch, logits, drafts, (ids_d, fed, pos_d))


def draft_columns(
    batch: Any, drafts: tuple[tuple[int, ...], ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``K`` columns that feed each row's draft after the batch's last column, ``[B, K]``
    each: the ids (a shorter draft padded with the row's pad), which of them are fed (1) or holes
    (0), and their positions (the row's last position counting on; 0 at a hole)."""
    K = max(len(d) for d in drafts)
    seqs = batch.seqs
    ids_d = torch.tensor([[*d, *[s.pad_id] * (K - len(d))] for s, d in zip(seqs, drafts, strict=True)],
                         dtype=torch.long)  # fmt: skip
    fed = torch.tensor([[1] * len(d) + [0] * (K - len(d)) for d in drafts], dtype=torch.long)
    ids_d, fed = ids_d.to(batch.device), fed.to(batch.device)
    last = batch.position_ids[:, -1:]
    pos_d = (last + fed.cumsum(-1)).masked_fill(fed == 0, 0)
    return ids_d, fed, pos_d


def settle(
    batch: Any,
    logits: torch.Tensor,
    drafts: tuple[tuple[int, ...], ...],
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> Verified:
    """After a forward that fed each row's last column and its draft (``columns``:
    ``draft_columns``; ``logits`` ``[B, K + 1, V]`` float32, the cache holding every fed column):
    each row's tokens committed as the plain engine draws them, then the batch's columns as
    after those tokens (``_keep_columns``). A verify forward's, and a prefill's that fed drafts
    after the prompt (``Batch.prefill_step``): its last column is the prompt's."""
    ids_d, fed, pos_d = columns
    mask = torch.cat([batch._full_mask(), fed], dim=-1)
    ids = torch.cat([batch.input_ids, ids_d], dim=-1)
    committed, accepted = _accept(batch.seqs, logits, drafts)
    _keep_columns(batch, ids, mask, pos_d, committed, ids_d.shape[1])
    return Verified(sum(len(d) for d in drafts), accepted, committed)


def _accept(
    seqs: list[Any], logits: torch.Tensor, drafts: tuple[tuple[int, ...], ...]
) -> tuple[list[int], list[int]]:
    """Walk the positions in order: draw, commit, compare. Greedy rows (no forced token) take
    every position's argmax at once, as the plain step takes each (an argmax is exact); rows
    that draw or may be forced go column by column, every such row still going at once.
    -> (tokens committed, draft tokens accepted) per row."""
    B = len(seqs)
    committed, accepted = [0] * B, [0] * B
    greedy, other = [], []
    for i, s in enumerate(seqs):
        if not s.finished:
            plain = not s.params.do_sample and s.forced_bos is None and s.forced_eos is None
            (greedy if plain else other).append(i)
    if greedy:
        _accept_greedy(seqs, logits, drafts, greedy, committed, accepted)
    if other:
        _accept_drawn(seqs, logits, drafts, other, committed, accepted)
    return committed, accepted


def _accept_greedy(
    seqs: list[Any],
    logits: torch.Tensor,
    drafts: tuple[tuple[int, ...], ...],
    rows: list[int],
    committed: list[int],
    accepted: list[int],
) -> None:
    """``_accept`` for greedy rows: one argmax over every position, each row's tokens up to its
    first miss (and the token there) committed in order; the logprobs of those only, in one
    ``chosen_logprobs`` (each row's value depends on its own logits alone)."""
    every = torch.argmax(logits, dim=-1)  # [B, W]: exactly the plain step's argmax per position
    tokens = (every if len(rows) == len(seqs) else every[rows]).tolist()  # [R][W] (no copy of the logits)
    runs = []
    for r, i in enumerate(rows):
        d, t = drafts[i], tokens[r]
        n = 0
        while n < len(d) and t[n] == d[n]:
            n += 1
        runs.append(n + 1)  # the matching draft tokens, then the target's own token
    lps: list[list[float]] | None = None
    want = [r for r, i in enumerate(rows) if seqs[i].params.logprobs]
    if want:
        pick = [(r, j) for r in want for j in range(runs[r])]
        W = logits.shape[1]
        at = torch.tensor([rows[r] * W + j for r, j in pick], device=logits.device)
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, at)
        chosen = torch.tensor([tokens[r][j] for r, j in pick], device=logits.device)
        got = chosen_logprobs(flat, chosen, [seqs[rows[r]].params for r, _ in pick]).tolist()
        lps = [[] for _ in rows]
        for (r, _), lp in zip(pick, got, strict=True):
            lps[r].append(lp)
    for r, i in enumerate(rows):
        s, t = seqs[i], tokens[r]
        for j in range(runs[r]):  # EOS, a stop string, the length or the budget end it where they fall
            s.append(t[j], lps[r][j] if lps is not None and s.params.logprobs else None)
            if s.finished or tokens_left(s) <= 0:
                break
        committed[i] = j + 1
        accepted[i] = min(j + 1, runs[r] - 1)  # the run's last token is a miss or past the draft


def _accept_drawn(
    seqs: list[Any],
    logits: torch.Tensor,
    drafts: tuple[tuple[int, ...], ...],
    rows: list[int],
    committed: list[int],
    accepted: list[int],
) -> None:
    """``_accept`` for rows that draw (or may be forced): column by column, one draw per committed
    token from the row's generator (``select_tokens``), as the plain step draws it."""
    going = list(rows)
    for j in range(logits.shape[1]):
        if not going:
            break
        idx = torch.tensor(going, device=logits.device)
        sub = logits[:, j].index_select(0, idx)  # [R, V]: each row's draw depends on its row alone
        params = [seqs[i].params for i in going]
        tokens = select_tokens(sub, params, [seqs[i].generator for i in going])
        forced = [(r, t) for r, i in enumerate(going) if (t := seqs[i].forced_token()) is not None]
        if forced:  # HF's forced tokens, as the plain step takes them
            tokens = tokens.clone()
            for r, t in forced:
                tokens[r] = t
        lps = None
        if any(p.logprobs for p in params):
            lps = chosen_logprobs(sub, tokens, params).tolist()
        still = []
        for r, (i, t) in enumerate(zip(going, tokens.tolist(), strict=True)):
            s, d = seqs[i], drafts[i]
            s.append(t, lps[r] if (lps is not None and s.params.logprobs) else None)
            committed[i] += 1
            hit = j < len(d) and t == d[j]
            accepted[i] += hit
            if hit and not s.finished and tokens_left(s) > 0:
                still.append(i)
        going = still


def _keep_columns(
    batch: Any, ids: torch.Tensor, mask: torch.Tensor, pos_d: torch.Tensor, committed: list[int], K: int
) -> None:
    """The batch after the forward: the draft columns kept where accepted (holes elsewhere), those
    that are holes in every row cropped (ids, mask, positions and cache), then each row's last
    committed token as the next column to feed (a finished row's: its pad, as the plain step)."""
    B, dev = len(batch.seqs), batch.device
    T = batch.input_ids.shape[1]
    keep = [max(0, c - 1) for c in committed]  # accepted draft columns kept per row
    width = max(keep)
    kept = torch.tensor([[1] * k + [0] * (K - k) for k in keep], dtype=torch.long, device=dev)
    mask = mask.clone()
    mask[:, T:] *= kept
    ids = ids.clone()
    pad = torch.tensor([s.pad_id for s in batch.seqs], dtype=torch.long, device=dev)[:, None]
    ids[:, T:] = torch.where(kept == 1, ids[:, T:], pad)
    pos_d = pos_d * kept
    cut = K - width  # draft columns that are holes in every row
    if cut:
        ids, mask, pos_d = ids[:, : T + width], mask[:, : T + width], pos_d[:, :width]
        for layer in batch._layers():
            n = layer.keys.shape[-2] - cut
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
    last = [s.tokens[-1] if c else s.pad_id for s, c in zip(batch.seqs, committed, strict=True)]
    step = torch.tensor([max(1, c) for c in committed], dtype=torch.long, device=dev)[:, None]
    nxt = torch.tensor(last, dtype=torch.long, device=dev)[:, None]
    batch.input_ids = torch.cat([ids, nxt], dim=-1)
    batch.position_ids = torch.cat([batch.position_ids, pos_d, batch.position_ids[:, -1:] + step], dim=-1)
    full = torch.cat([mask, mask.new_ones((B, 1))], dim=-1)
    batch.attention_mask = None if bool((full == 1).all()) else full  # HF drops an all-ones mask
    batch.steps += 1
    batch._reserve()
