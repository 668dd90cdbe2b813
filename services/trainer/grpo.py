"""The GRPO loss, as pure functions with visible shapes.

Formulation (B = samples in the batch, T = padded sequence length, G = group size):

    A_i      = (r_i - mean(r_group(i))) / (std(r_group(i)) + 1e-4)    # group-normalized advantage
                                                  # (without the std when scale_by_std is off)
    rho_it   = exp(logp_theta(y_it) - logp_sample(y_it))              # sampler's logprobs as "old"
    L_clip   = -sum_it m_it * min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) / sum_it m_it
    L_kl     = beta * sum_it m_it * k3(logp_ref - logp_theta) / sum_it m_it,   k3(x) = e^x - x - 1
    L        = L_clip + L_kl

Where it deviates from the textbook: the loss is averaged over *tokens* of the
whole batch (DAPO's token-level aggregation), not per sequence then per batch, so
long answers are not down-weighted; the "old" logprobs are the inference engine's
sampling logprobs (the job is strictly on-policy, so rho is 1 up to the engine-vs-
trainer numerical gap, which is reported as ``logprob_gap``); the reference policy
of the KL term is the base model itself (the LoRA disabled), and the KL is off by
default (beta = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards_B: torch.Tensor, groups_B: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """Center each reward on its group's mean (and divide by its std); equal rewards get 0."""
    advantages_B = torch.zeros_like(rewards_B)
    for group in groups_B.unique():
        members = groups_B == group
        r = rewards_B[members]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.tensor(0.0)
        advantages_B[members] = (r - r.mean()) / (std + 1e-4) if scale_by_std else r - r.mean()
    return advantages_B


def token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: position t scores token t+1 (last position scores 0)."""
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V[:, :-1].float(), dim=-1)
    picked_B_T = logprobs_B_T_V.gather(-1, tokens_B_T[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked_B_T, (1, 0))  # align: entry t is log p(token_t)


@dataclass(frozen=True)
class GrpoLoss:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    logprob_gap: float


def grpo_loss(
    logprobs_B_T: torch.Tensor, sample_logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor,
    advantages_B: torch.Tensor, clip_eps: float, kl_coef: float = 0.0,
    ref_logprobs_B_T: torch.Tensor | None = None,
) -> GrpoLoss:
    """Token-level clipped policy-gradient loss plus the optional k3 KL to the reference."""
    mask_B_T = mask_B_T.float()
    tokens = mask_B_T.sum().clamp(min=1.0)
    log_ratio_B_T = (logprobs_B_T - sample_logprobs_B_T) * mask_B_T
    ratio_B_T = torch.exp(log_ratio_B_T)
    adv_B_1 = advantages_B.unsqueeze(-1)
    unclipped = ratio_B_T * adv_B_1
    clipped = torch.clamp(ratio_B_T, 1 - clip_eps, 1 + clip_eps) * adv_B_1
    loss = -(torch.minimum(unclipped, clipped) * mask_B_T).sum() / tokens
    kl = torch.tensor(0.0)
    if kl_coef > 0:
        if ref_logprobs_B_T is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs_B_T")
        delta_B_T = ref_logprobs_B_T - logprobs_B_T
        kl = ((torch.exp(delta_B_T) - delta_B_T - 1) * mask_B_T).sum() / tokens
        loss = loss + kl_coef * kl
    with torch.no_grad():
        was_clipped = ((ratio_B_T - 1).abs() > clip_eps).float() * mask_B_T
        gap = (log_ratio_B_T.abs().sum() / tokens).item()
    return GrpoLoss(loss, (was_clipped.sum() / tokens).item(), float(kl), gap)
