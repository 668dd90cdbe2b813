"""The Tinker API's loss functions: pure, per datum, summed over tokens (and, by the caller, datums).

Each takes the model's logprobs of the datum's ``target_tokens`` (``logprobs_T``: position t
scores ``target_tokens[t]`` given ``model_input[:t+1]``) and the datum's other inputs, and
returns (loss, outputs). The formulations are Tinker's documented ones:

- ``cross_entropy``: ``-sum_t w_t * lp_t``, with arbitrary real weights (negative ones too:
  ``forward_backward_custom`` relies on them);
- ``importance_sampling``: ``-sum_t exp(lp_t - q_t) * A_t`` (q: the sampler's logprobs);
- ``ppo``: ``-sum_t min(r_t * A_t, clip(r_t, low, high) * A_t)``, r = exp(lp - q), with
  ``clip_low_threshold`` / ``clip_high_threshold`` from ``loss_fn_config`` (default 0.8, 1.2);
- ``cispo``: ``-sum_t sg(clip(r_t, low, high)) * lp_t * A_t``: the clipped ratio a coefficient
  with no gradient of its own, so no token's gradient is zeroed (default low 0, high 4: one-sided);
- ``dro``: ``-sum_t (lp_t * A_t - beta / 2 * (lp_t - q_t)^2)``, ``beta`` from ``loss_fn_config``
  (default :data:`DRO_BETA`: Tinker's documentation gives none, its example uses 0.05).
- ``stable_reinforce``: REINFORCE on the *engine's* logprobs rather than the client's. Its datums
  carry provenance (``Datum.with_provenance``): which positions are which recorded sequence's
  sampled tokens (sampled with ``record_stability_info``: ``SequenceRecord``). Only those positions
  train; q_t is the recorded logprob, the importance weight is truncated and carries no gradient,
  and an optional k3 estimate of KL(sampler || policy) keeps the policy near the sampler:
  ``sum_t m_t * (-sg(min(r_t, cap)) * A_t * lp_t + kl_coeff * (exp(q_t - lp_t) - (q_t - lp_t) - 1))``
  (``cap``: ``clip_high_threshold``, default :data:`STABLE_CAP`; ``kl_coeff`` default 0). Tinker
  documents the loss's inputs and its ``kl_coeff`` but not its formula: this is marlaas's reading
  (truncated importance sampling, as AReaL and verl correct sampler/trainer mismatch), and a datum
  whose provenance does not match the recorded tokens is refused rather than trained on.

- ``gspo``: the sequence-level ratio of GSPO (Zheng et al., 2025), r = exp(mean over the ratio mask
  of (lp_t - q_t)) (``sequence_ratio_mask``, 1 on the sampled tokens; all tokens when absent),
  clipped to ``[clip_low_threshold, clip_high_threshold]`` (default :data:`GSPO_CLIP`, the paper's
  1 - 3e-4 and 1 + 4e-4); each masked token carries ``-min(r A_t, clip(r) A_t) / |mask|`` with the
  gradient of ``r * lp_t`` (GSPO-token: r's value, no gradient through the mean), so a sequence
  with one advantage weighs once whatever its length.

Not served (a clear error names the seven above): custom losses run server-side;
``forward_backward_custom`` works, as it is cross_entropy with the client's weights.
"""

from __future__ import annotations

import torch

from marlaas.platform.tinker_records import LOSSES

INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "stable_reinforce": ("target_tokens", "advantages", "recorded_logprobs", "recorded_mask"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
}
GSPO_CLIP = (1 - 3e-4, 1 + 4e-4)
DRO_BETA = 0.05
STABLE_CAP = 2.0  # stable_reinforce's truncation of the importance weight
MAX_SPANS = 4096  # provenance spans in one request (each names a recorded sequence)


class LossInputError(ValueError):
    """A datum the loss cannot use: the message says which input is wrong and how."""


def check_loss(loss_fn: str) -> None:
    if loss_fn not in LOSSES:
        raise LossInputError(f"loss_fn {loss_fn!r} is not served here: use one of {', '.join(LOSSES)} "
                             "(custom losses: forward_backward_custom, which sends cross_entropy weights)")


def check_inputs(loss_fn: str, T: int, inputs: dict[str, torch.Tensor]) -> None:
    """Raise :class:`LossInputError` unless ``inputs`` hold what ``loss_fn`` needs, one value per token."""
    for name in INPUTS[loss_fn][1:]:
        if name not in inputs:
            raise LossInputError(f"{loss_fn} needs loss_fn_inputs {list(INPUTS[loss_fn])}; {name!r} is missing")
        if inputs[name].numel() != T:
            raise LossInputError(f"loss_fn_inputs[{name!r}] has {inputs[name].numel()} values for {T} target tokens")


def datum_loss(loss_fn: str, logprobs_T: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's loss (a scalar) and its outputs (``logprobs``, and ``elementwise_loss``)."""
    check_inputs(loss_fn, logprobs_T.shape[0], inputs)
    if loss_fn == "cross_entropy":
        elementwise_T = -inputs["weights"].float() * logprobs_T
    elif loss_fn == "stable_reinforce":
        recorded_T, mask_T = inputs["recorded_logprobs"].float(), inputs["recorded_mask"].float()
        gap_T = recorded_T - logprobs_T
        weight_T = torch.clamp(torch.exp(-gap_T), max=config.get("clip_high_threshold", STABLE_CAP)).detach()
        kl_T = torch.exp(gap_T) - gap_T - 1
        elementwise_T = mask_T * (-weight_T * inputs["advantages"].float() * logprobs_T
                                  + config.get("kl_coeff", 0.0) * kl_T)
    elif loss_fn == "gspo":
        mask_T = inputs["sequence_ratio_mask"].float() if "sequence_ratio_mask" in inputs \
            else torch.ones_like(logprobs_T)
        if mask_T.numel() != logprobs_T.numel():
            raise LossInputError(f"loss_fn_inputs['sequence_ratio_mask'] has {mask_T.numel()} values for "
                                 f"{logprobs_T.numel()} target tokens")
        count = mask_T.sum().clamp(min=1.0)
        ratio = torch.exp(((logprobs_T - inputs["logprobs"].float()) * mask_T).sum() / count).detach()
        token_ratio_T = ratio * torch.exp(logprobs_T - logprobs_T.detach())  # r's value, the gradient of r * lp_t
        low, high = config.get("clip_low_threshold", GSPO_CLIP[0]), config.get("clip_high_threshold", GSPO_CLIP[1])
        advantages_T = inputs["advantages"].float()
        elementwise_T = -mask_T / count * torch.minimum(token_ratio_T * advantages_T,
                                                        torch.clamp(token_ratio_T, low, high) * advantages_T)
    else:
        ratio_T = torch.exp(logprobs_T - inputs["logprobs"].float())
        advantages_T = inputs["advantages"].float()
        if loss_fn == "importance_sampling":
            elementwise_T = -ratio_T * advantages_T
        elif loss_fn == "cispo":
            low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
            elementwise_T = -torch.clamp(ratio_T, low, high).detach() * logprobs_T * advantages_T
        elif loss_fn == "dro":
            beta = config.get("beta", DRO_BETA)
            gap_T = logprobs_T - inputs["logprobs"].float()
            elementwise_T = -(logprobs_T * advantages_T - 0.5 * beta * gap_T * gap_T)
        else:
            low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
            clipped_T = torch.clamp(ratio_T, low, high)
            elementwise_T = -torch.minimum(ratio_T * advantages_T, clipped_T * advantages_T)
    return elementwise_T.sum(), {"logprobs": logprobs_T.detach(), "elementwise_loss": elementwise_T.detach()}


def provenance_inputs(i: int, targets_T: torch.Tensor, spans: list[tuple[str, str, int, int]],
                      records: dict) -> dict[str, torch.Tensor]:
    """Datum ``i``'s ``recorded_logprobs`` and ``recorded_mask`` (1 where a target is a recorded
    sequence's sampled token) from its ``loss_fn_input_spans`` (kind "prompt" | "sampled",
    sequence_id, offset, length), checked against the recorded sequences (``records``: id ->
    ``SequenceRecord``, the tenant's own). :class:`LossInputError` names the first mismatch."""
    if not spans:
        raise LossInputError(f"datum {i}: stable_reinforce needs provenance (Datum.with_provenance) naming the "
                             "sampled sequences its targets come from; sample with record_stability_info=True")
    if sum(length for *_, length in spans) != targets_T.numel():
        raise LossInputError(f"datum {i}: its provenance spans cover {sum(length for *_, length in spans)} "
                             f"positions, its target_tokens {targets_T.numel()}")
    recorded_T, mask_T = torch.zeros(targets_T.numel()), torch.zeros(targets_T.numel())
    at = 0
    for kind, sequence_id, offset, length in spans:
        record = records.get(sequence_id)
        if offset < 0 or length < 0:
            raise LossInputError(f"datum {i}: a provenance span has offset {offset}, length {length}: both are >= 0")
        if record is None:
            raise LossInputError(f"datum {i}: no recorded sequence {sequence_id!r} of yours: sample with "
                                 "record_stability_info=True (records are kept an hour)")
        source = record.prompt if kind == "prompt" else record.tokens
        claimed = source[offset:offset + length]
        if len(claimed) != length or targets_T[at:at + length].tolist() != claimed:
            raise LossInputError(f"datum {i}: target positions {at}..{at + length - 1} are not tokens "
                                 f"{offset}..{offset + length - 1} of sequence {sequence_id!r}'s {kind} tokens")
        if kind == "sampled":
            recorded_T[at:at + length] = torch.tensor(record.logprobs[offset:offset + length])
            mask_T[at:at + length] = 1.0
        at += length
    return {"recorded_logprobs": recorded_T, "recorded_mask": mask_T}
