"""The GRPO loss: advantages, logprob alignment, clipping, KL, gradient direction."""

import torch

from services.trainer.grpo import group_advantages, grpo_loss, token_logprobs


def test_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.8])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert adv[0] > 0 > adv[1]
    assert torch.allclose(adv[2:4], torch.zeros(2))  # equal rewards: no signal
    for g in range(3):
        assert abs(adv[groups == g].sum().item()) < 1e-5


def test_token_logprobs_score_the_next_token():
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    lp = token_logprobs(logits, tokens)
    expected = torch.log_softmax(logits[1, 2], -1)[tokens[1, 3]]
    assert torch.isclose(lp[1, 3], expected)
    assert torch.all(lp[:, 0] == 0)


def test_loss_raises_the_probability_of_positive_advantage_tokens():
    logits = torch.zeros(2, 3, requires_grad=True)  # two one-token "sequences" over 3 tokens
    lp = torch.log_softmax(logits, -1)[:, 1]  # both sampled token 1
    out = grpo_loss(lp[:, None], lp.detach()[:, None], torch.ones(2, 1),
                    advantages_B=torch.tensor([1.0, -1.0]), clip_eps=0.2)
    out.loss.backward()
    assert logits.grad[0, 1] < 0  # descending the loss raises token 1 for the good sample
    assert logits.grad[1, 1] > 0
    assert out.clip_fraction == 0.0 and out.logprob_gap == 0.0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    new = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1.2
    out = grpo_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([1.0]), clip_eps=0.2)
    out.loss.backward()
    assert new.grad.abs().item() == 0.0
    assert out.clip_fraction == 1.0


def test_masked_tokens_do_not_count_and_kl_is_zero_at_the_reference():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = grpo_loss(lp, lp, mask, torch.tensor([2.0]), clip_eps=0.2, kl_coef=0.5, ref_logprobs_B_T=lp)
    assert torch.isclose(out.loss, torch.tensor(-2.0))  # mean over the 2 unmasked tokens of -A
    assert out.kl == 0.0
