"""The off-policy-corrected loss of examples/partial_rollouts.py (AReaL's decoupled PPO objective
with TRL's truncated importance weights): on the current policy's own tokens it is the plain
policy gradient; a token drawn by older weights weighs exp(logp - behaviour logp), at most the cap."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

# loaded from its file: examples/ is not a package
_path = Path(__file__).resolve().parents[2] / "examples" / "partial_rollouts.py"
_spec = importlib.util.spec_from_file_location("partial_rollouts_example", _path)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
decoupled_loss = _example.decoupled_loss


def _grads(loss_of) -> torch.Tensor:
    logits = torch.tensor([[0.3, -1.2, 0.5], [2.0, 0.1, -0.4]], requires_grad=True)
    loss_of(torch.log_softmax(logits, -1)).backward()
    return logits.grad


def test_on_the_current_policy_it_is_the_plain_policy_gradient():
    adv, mask = torch.tensor([0.7, -0.4]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

    def decoupled(lp):
        loss, weights = decoupled_loss(lp, lp.detach(), adv, mask, cap=3.0, clip=0.2)
        assert torch.allclose(weights, mask.sum())  # every weight 1
        return loss

    plain = _grads(lambda lp: -(adv[:, None] * lp * mask).sum())
    assert torch.allclose(_grads(decoupled), plain)


def test_older_tokens_weigh_their_probability_ratio_truncated_at_the_cap():
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.4]])).requires_grad_()
    # drawn by older weights: 5x less likely then (weight 5, truncated to 3), 2x more likely
    # (weight 1/2), the same; the third token is padding (mask 0)
    behaviour = lp.detach() + torch.tensor([[-math.log(5.0), math.log(2.0), 0.0]])
    mask, adv = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([2.0])
    loss, weights = decoupled_loss(lp, behaviour, adv, mask, cap=3.0, clip=0.2)
    assert math.isclose(weights.item(), 3.0 + 0.5, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0 * 3.0, -2.0 * 0.5, 0.0]]))
