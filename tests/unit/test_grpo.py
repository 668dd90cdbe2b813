"""The GRPO loss: advantages, tempered scoring, micro-batch shares, clipping, KL, gradient direction."""

import pytest
import torch

from services.trainer.grpo import (
    group_advantages,
    grpo_loss,
    head_logprobs,
    micro_batches,
    scored_positions,
    token_logprobs,
)


def test_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.8])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert adv[0] > 0 > adv[1]
    assert torch.allclose(adv[2:4], torch.zeros(2))  # equal rewards: no signal
    for g in range(3):
        assert abs(adv[groups == g].sum().item()) < 1e-5


def test_a_group_of_equal_rewards_gets_exactly_zero_advantages():
    """Eight rewards of 0.3 average to 0.3 only up to the last bit; the std floor would blow that up."""
    rewards = torch.tensor([0.3] * 8 + [0.3] * 7 + [0.9])
    groups = torch.tensor([0] * 8 + [1] * 8)
    assert (rewards[:8] - rewards[:8].mean()).abs().max() > 0  # the residue this guards against
    for scale_by_std in (True, False):
        adv = group_advantages(rewards, groups, scale_by_std)
        assert torch.equal(adv[:8], torch.zeros(8))
        assert (adv[8:] != 0).all()
    assert torch.equal(group_advantages(torch.tensor([0.7]), torch.tensor([0])), torch.zeros(1))  # a group of one


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


def test_advantages_have_zero_mean_and_unit_std_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.2, 0.9, 0.4, 0.4, 0.1])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    for g in (0, 1):
        members = adv[groups == g]
        assert abs(members.mean().item()) < 1e-3
        assert abs(members.std(unbiased=False).item() - 1.0) < 1e-3  # population std, up to the 1e-4


def test_dr_grpo_advantages_are_centered_but_not_scaled():
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.4, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups, scale_by_std=False)
    for g in (0, 1):
        r = rewards[groups == g]
        assert torch.allclose(adv[groups == g], r - r.mean())
    assert abs(adv[groups == 0].std(unbiased=False).item() - 1.0) > 0.1


def test_tempered_scoring_is_log_softmax_of_the_scaled_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    tokens = torch.randint(0, 11, (2, 6))
    tempered = token_logprobs(logits, tokens, temperature=0.7)
    expected = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(tempered[:, 1:], expected, atol=1e-6)
    # a trainer scoring at T=1 would see a gap on every token of an on-policy batch
    assert (tempered[:, 1:] - token_logprobs(logits, tokens)[:, 1:]).abs().min() > 1e-3


def test_chunked_head_scoring_matches_full_logits_in_value_and_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 13, (10,))
    chunked = head_logprobs(hidden, targets, head, temperature=0.7, chunk=3)  # 4 chunks, the last short
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    full = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    (grad_full,) = torch.autograd.grad(full.sum(), hidden)
    assert torch.allclose(chunked, full, atol=1e-6)
    assert torch.allclose(grad_chunked, grad_full, atol=1e-6)


def test_scored_positions_skip_unmasked_tokens_and_the_first_position():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    rows, cols = scored_positions(mask)
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 2), (0, 3), (1, 1)]


def test_micro_batches_fit_the_budget_and_an_oversized_sample_stands_alone():
    lengths = [5, 30, 7, 7, 12, 3, 6, 40]
    groups = micro_batches(lengths, token_budget=24)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(lengths[i] for i in g)
        assert len(g) * width <= 24 or len(g) == 1
    assert [7] in groups and [1] in groups  # 40 and 30 tokens: over budget, alone
    assert micro_batches(lengths, token_budget=10_000) == [sorted(range(8), key=lambda i: -lengths[i])]


def test_micro_batch_shares_sum_to_the_whole_batch_loss_and_metrics():
    torch.manual_seed(0)
    lp = torch.randn(4, 5) * 0.3 - 1
    sample = lp + torch.randn(4, 5) * 0.3  # some ratios beyond the trust region
    ref = lp + torch.randn(4, 5) * 0.2
    mask = (torch.rand(4, 5) > 0.3).float()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])
    whole = grpo_loss(lp, sample, mask, adv, 0.2, kl_coef=0.1, ref_logprobs_B_T=ref)
    n = mask.sum().item()
    parts = [grpo_loss(lp[r], sample[r], mask[r], adv[r], 0.2, 0.1, ref[r], total_tokens=n)
             for r in ([0, 2], [1], [3])]
    assert torch.isclose(sum(p.loss for p in parts), whole.loss, atol=1e-6)
    for name in ("clip_fraction", "kl", "logprob_gap"):
        assert abs(sum(getattr(p, name) for p in parts) - getattr(whole, name)) < 1e-6
    assert 0 < whole.clip_fraction < 1 and whole.kl > 0


def test_kl_is_positive_off_the_reference_and_its_gradient_pulls_back_to_it():
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)  # one token above, one below the reference
    ref = torch.tensor([[-1.0, -1.0]])
    out = grpo_loss(lp, lp.detach(), torch.ones(1, 2), torch.zeros(1), clip_eps=0.2,
                    kl_coef=1.0, ref_logprobs_B_T=ref)
    out.loss.backward()
    assert out.kl > 0
    assert lp.grad[0, 0] > 0 and lp.grad[0, 1] < 0  # descending moves both logprobs toward ref
    stepped = lp.detach() - 0.1 * lp.grad
    assert ((stepped - ref).abs() < (lp.detach() - ref).abs()).all()


def test_lower_side_clipping_stops_the_gradient_of_a_negative_advantage():
    new = torch.tensor([[-0.5]], requires_grad=True)  # ratio e^-0.5 < 0.8, already pushed down
    out = grpo_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([-1.0]), clip_eps=0.2)
    out.loss.backward()
    assert new.grad.abs().item() == 0.0
    assert out.clip_fraction == 1.0


def test_a_group_with_dropped_members_is_normalized_over_those_left():
    """grpo.truncated = "drop" leaves a group's truncated samples out of the batch: the group keeps
    its number and its baseline is the mean of the members that answered."""
    rewards = torch.tensor([1.0, 0.0, 0.4, 0.6])  # group 0 lost two of four; group 1 lost three of four
    groups = torch.tensor([0, 0, 2, 1])  # group 2 kept one; groups need not be contiguous or complete
    adv = group_advantages(rewards, groups)
    assert torch.allclose(adv[:2], torch.tensor([1.0, -1.0]), atol=1e-3)
    assert adv[2] == 0 and adv[3] == 0  # a group of one has no baseline to beat: no signal
    assert group_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long)).numel() == 0  # all dropped


def test_a_stale_batch_gets_the_importance_weighted_gradient_truncated_at_the_cap():
    """Decoupled objective: d loss / d logp = -min(pi_prox / mu, W) * A / N per token (the ratio
    to the proximal policy is 1 at the one step), whatever the behaviour gap; unweighted, the
    same tokens would be clipped away once pi / mu leaves the trust region."""
    from services.trainer.grpo import BEHAVIOUR_WEIGHT_CAP

    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -2.5, -2.0, -1.3]])  # mu: an older version's logprobs
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    advantages = torch.tensor([0.7])
    out = grpo_loss(logprobs, behaviour, mask, advantages, clip_eps=0.2, decoupled=True)
    out.loss.backward()
    weights = torch.exp(logprobs.detach() - behaviour).clamp(max=BEHAVIOUR_WEIGHT_CAP)
    expected = -weights * 0.7 * mask / 3
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert weights[0, 2] == BEHAVIOUR_WEIGHT_CAP  # exp(1.5) = 4.5, truncated
    assert out.clip_fraction == 0.0  # the trust region is around the proximal policy
    assert abs(out.logprob_gap - (0.0 + 0.5 + 1.5) / 3) < 1e-6  # the behaviour gap, reported

    logprobs.grad = None
    plain = grpo_loss(logprobs, behaviour, mask, advantages, clip_eps=0.2)
    plain.loss.backward()
    assert logprobs.grad[0, 1] == 0 and logprobs.grad[0, 2] == 0  # ratio 1.65 and 4.5: clipped


def test_a_batch_of_the_trained_version_has_the_same_loss_decoupled_or_not():
    torch.manual_seed(0)
    logprobs = torch.randn(2, 5)
    mask = torch.ones(2, 5)
    advantages = torch.tensor([0.5, -0.5])
    a = grpo_loss(logprobs, logprobs.clone(), mask, advantages, clip_eps=0.2)
    b = grpo_loss(logprobs, logprobs.clone(), mask, advantages, clip_eps=0.2, decoupled=True)
    assert torch.allclose(a.loss, b.loss)


def test_the_supervised_loss_is_the_masked_mean_nll_and_its_shares_sum():
    from services.trainer.grpo import supervised_loss

    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    out = supervised_loss(logprobs, mask)
    assert out.loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    shares = [supervised_loss(logprobs[i:i + 1], mask[i:i + 1], total_tokens=3).loss.item() for i in range(2)]
    assert sum(shares) == pytest.approx(out.loss.item())
    out.loss.backward()
    assert torch.equal(logprobs.grad, -mask.float() / 3)
