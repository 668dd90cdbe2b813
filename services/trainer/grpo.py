"""The GRPO loss, as pure functions with visible shapes.

Formulation (B = samples in the batch, T = padded sequence length, G = group size,
tau = the job's sampling temperature, z_it = the logits that predict token y_it):

    A_i      = (r_i - mean(r_group(i))) / (std(r_group(i)) + 1e-4)    # group-normalized advantage
                                                  # (without the std when scale_by_std is off)
    logp(y_it) = log_softmax(z_it / tau)[y_it]                        # the *tempered* policy
    rho_it   = exp(logp_theta(y_it) - logp_sample(y_it))              # sampler's logprobs as "old"
    N        = sum_it m_it                                            # masked tokens of the batch
    L_clip   = -sum_it m_it * min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) / N
    L_kl     = beta * sum_it m_it * k3(logp_ref - logp_theta) / N,   k3(x) = e^x - x - 1
    L        = L_clip + L_kl

Where it deviates from the textbook: the loss is averaged over *tokens* of the
whole batch (DAPO's token-level aggregation), not per sequence then per batch, so
long answers are not down-weighted; the "old" logprobs are the inference engine's
sampling logprobs (the job is strictly on-policy, so rho is 1 up to the engine-vs-
trainer numerical gap, which is reported as ``logprob_gap``); the reference policy
of the KL term is the base model itself (the LoRA disabled), and the KL is off by
default (beta = 0).

Temperature: the engine samples from softmax(z / tau) and reports those processed
logprobs (no top-k / top-p), so the trainer scores the same tempered distribution,
and so is the reference of the KL term; scoring at tau = 1 would make rho != 1 on
every token of an on-policy batch.

Bounded staleness (``grpo.max_staleness`` = k >= 1): a batch may be sampled by a version b up
to k behind the version s it trains (the behaviour policy mu = pi_b; the engine's logprobs are
mu's). It is trained with the decoupled objective (AReaL's decoupled PPO): the proximal policy
is the committed version s itself (pi_prox = pi_theta before the step, detached), and

    w_it     = min(exp(logp_prox(y_it) - logp_mu(y_it)), W)                # truncated, W = 2
    r_it     = exp(logp_theta(y_it) - logp_prox(y_it))                     # 1 at the one step
    L_clip   = -sum_it m_it * w_it * min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) / N

so the gradient is the importance-weighted policy gradient with the off-policy gap corrected
token by token, and the clip (eps, the job's clip_eps) bounds the move from the proximal policy,
not from the stale behaviour policy. A batch of staleness 0 keeps the formula above (rho against
the sampler's logprobs). ``logprob_gap`` is then the behaviour gap |logp_prox - logp_mu|, large
by design; the audit checks it only on batches of staleness 0.

Supervised batches (``TrajectoryBatch.objective = "sft"``, the ``sft`` task) go through the same
path with the cross-entropy of their masked tokens (the assistant's, at tau = 1) as the loss,

    L_sft    = -sum_it m_it * logp_theta(y_it) / N

aggregated over tokens as L_clip is: one sample type, one packing, one accumulation and step.

Micro-batching is exact: L is a sum over tokens divided by the constant N of the
*whole* batch, so a micro-batch contributes its own token sum over that same N
(``grpo_loss(..., total_tokens=N)``) and the accumulated gradients and summed
metrics equal the whole-batch ones (up to float rounding). Advantages are computed
over the whole batch before it is split. Token logprobs are computed from final
hidden states a chunk of positions at a time (``head_logprobs``), so the B x T x V
fp32 log-softmax is never materialized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

BEHAVIOUR_WEIGHT_CAP = 2.0  # W: a stale batch's importance weights pi_prox / mu are truncated here


def group_advantages(rewards_B: torch.Tensor, groups_B: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """Center each reward on its group's mean (and divide by its std); equal rewards get exactly 0.

    Exactly: the float mean of equal rewards can differ from them in the last bit (eight
    rewards of 0.3 leave residues of 3e-8, which the 1e-4 floor of the std turns into
    advantages of 3e-4), and the trainer skips samples whose advantage is 0.
    """
    advantages_B = torch.zeros_like(rewards_B)
    for group in groups_B.unique():
        members = groups_B == group
        r = rewards_B[members]
        if bool((r == r[0]).all()):  # a group of one included
            continue
        std = r.std(unbiased=False)
        advantages_B[members] = (r - r.mean()) / (std + 1e-4) if scale_by_std else r - r.mean()
    return advantages_B


def micro_batches(lengths_B: Sequence[int], token_budget: int) -> list[list[int]]:
    """Split sample indices into micro-batches of at most ``token_budget`` padded tokens.

    Samples are taken longest first, so each micro-batch holds similar lengths and
    little padding; a micro-batch's cost is rows x its longest row. A sample longer
    than the budget is a micro-batch of its own.
    """
    order = sorted(range(len(lengths_B)), key=lambda i: -lengths_B[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths_B[current[0]] > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Tempered log-probability of each next token from full logits (entry t is log p(token_t)).

    Position t's logits score token t+1; entry 0 has no predictor and is 0. This
    materializes B x T x V fp32: the fallback for models whose head cannot be split off.
    """
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V[:, :-1].float() / temperature, dim=-1)
    picked_B_T = logprobs_B_T_V.gather(-1, tokens_B_T[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked_B_T, (1, 0))


def scored_positions(mask_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every masked-in token that has a predecessor to score it from."""
    rows_N, cols_N = torch.nonzero(mask_B_T[:, 1:], as_tuple=True)
    return rows_N, cols_N + 1


def _chunk_logprobs(hidden_C_H: torch.Tensor, targets_C: torch.Tensor,
                    head: Callable[[torch.Tensor], torch.Tensor], temperature: float) -> torch.Tensor:
    logits_C_V = head(hidden_C_H).float() / temperature
    return logits_C_V.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits_C_V, dim=-1)


def head_logprobs(hidden_N_H: torch.Tensor, targets_N: torch.Tensor,
                  head: Callable[[torch.Tensor], torch.Tensor], temperature: float = 1.0,
                  chunk: int = 256) -> torch.Tensor:
    """log_softmax(head(h_n) / tau)[y_n] for N hidden states, ``chunk`` positions at a time.

    Each chunk's logits are fp32 and recomputed in backward (activation
    checkpointing), so peak memory is a few chunk x V tensors (256 x 152k fp32 is
    156 MB), not N x V.
    """
    pieces = []
    for start in range(0, hidden_N_H.shape[0], chunk):
        h_C_H, y_C = hidden_N_H[start:start + chunk], targets_N[start:start + chunk]
        if torch.is_grad_enabled() and h_C_H.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, h_C_H, y_C, head, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h_C_H, y_C, head, temperature))
    return torch.cat(pieces) if pieces else hidden_N_H.new_zeros(0, dtype=torch.float32)


@dataclass(frozen=True)
class GrpoLoss:
    """The loss to backpropagate and its metrics, each already divided by the batch's token count."""

    loss: torch.Tensor
    clip_fraction: float
    kl: float
    logprob_gap: float


def grpo_loss(
    logprobs_B_T: torch.Tensor, sample_logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor,
    advantages_B: torch.Tensor, clip_eps: float, kl_coef: float = 0.0,
    ref_logprobs_B_T: torch.Tensor | None = None, total_tokens: float | None = None,
    decoupled: bool = False,
) -> GrpoLoss:
    """Token-level clipped policy-gradient loss plus the optional k3 KL to the reference.

    ``total_tokens`` is N, the masked-token count of the whole batch; pass it when
    these rows are one micro-batch, and the results (loss and metrics) are this
    micro-batch's share, which sum over micro-batches to the whole-batch values.
    Defaults to this call's own mask count. ``decoupled``: the rows were sampled by an older
    version (``sample_logprobs_B_T`` are the behaviour policy's): the decoupled objective above.
    """
    mask_B_T = mask_B_T.float()
    tokens = max(float(mask_B_T.sum()) if total_tokens is None else total_tokens, 1.0)
    log_ratio_B_T = (logprobs_B_T - sample_logprobs_B_T) * mask_B_T
    weights_B_T = torch.ones_like(mask_B_T)
    if decoupled:  # ratio against the proximal policy (this version, detached), weighted by pi_prox / mu
        weights_B_T = torch.exp(log_ratio_B_T.detach()).clamp(max=BEHAVIOUR_WEIGHT_CAP)
        ratio_B_T = torch.exp((logprobs_B_T - logprobs_B_T.detach()) * mask_B_T)
    else:
        ratio_B_T = torch.exp(log_ratio_B_T)
    adv_B_1 = advantages_B.unsqueeze(-1)
    unclipped = ratio_B_T * adv_B_1
    clipped = torch.clamp(ratio_B_T, 1 - clip_eps, 1 + clip_eps) * adv_B_1
    loss = -(weights_B_T * torch.minimum(unclipped, clipped) * mask_B_T).sum() / tokens
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
    return GrpoLoss(loss, (was_clipped.sum() / tokens).item(), kl.detach().item(), gap)


def supervised_loss(logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor, total_tokens: float | None = None) -> GrpoLoss:
    """The masked tokens' mean negative log-likelihood (``total_tokens`` as in :func:`grpo_loss`)."""
    mask_B_T = mask_B_T.float()
    tokens = max(float(mask_B_T.sum()) if total_tokens is None else total_tokens, 1.0)
    loss = -(logprobs_B_T * mask_B_T).sum() / tokens
    return GrpoLoss(loss, 0.0, 0.0, 0.0)
