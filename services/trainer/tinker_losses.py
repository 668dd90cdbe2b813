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

Not served (a clear error names the five above): ``gspo`` and custom losses run server-side;
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
}
DRO_BETA = 0.05


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
