"""The Tinker API's losses (services/trainer/tinker_losses.py): Tinker's formulations, per datum."""

from __future__ import annotations

import math

import pytest
import torch

from marlaas.platform import tinker_records as wire
from services.trainer.tinker_losses import LossInputError, check_loss, datum_loss


def test_cross_entropy_is_minus_the_weighted_logprobs_with_any_real_weights():
    logprobs_T = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    weights = torch.tensor([1.0, 0.0, -2.0])  # negative weights push a token's logprob down
    loss, out = datum_loss("cross_entropy", logprobs_T, {"weights": weights}, {})
    assert loss.item() == pytest.approx(1.0 - 1.0)  # -(1 * -1) - (-2 * -0.5)
    loss.backward()
    assert logprobs_T.grad.tolist() == [-1.0, 0.0, 2.0]
    assert out["elementwise_loss"].tolist() == [1.0, 0.0, -1.0]
    assert out["logprobs"].tolist() == [-1.0, -2.0, -0.5]


def test_importance_sampling_weighs_advantages_by_the_ratio():
    logprobs_T = torch.tensor([-1.0, -2.0])
    inputs = {"logprobs": torch.tensor([-1.0, -2.0 - math.log(2)]), "advantages": torch.tensor([1.0, 3.0])}
    loss, _ = datum_loss("importance_sampling", logprobs_T, inputs, {})
    assert loss.item() == pytest.approx(-(1.0 * 1.0 + 2.0 * 3.0))


def test_ppo_clips_the_ratio_where_that_lowers_the_objective():
    logprobs_T = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    sampled = torch.tensor([-math.log(2), math.log(2), 0.0])  # ratios 2, 0.5, 1
    inputs = {"logprobs": sampled, "advantages": torch.tensor([1.0, -1.0, 1.0])}
    loss, _ = datum_loss("ppo", logprobs_T, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 0.8 * -1.0 + 1.0))
    loss.backward()
    assert logprobs_T.grad.tolist() == pytest.approx([0.0, 0.0, -1.0])  # clipped tokens get no gradient


def test_cispo_weighs_each_tokens_logprob_by_its_clipped_ratio_with_no_gradient_through_it():
    logprobs_T = torch.tensor([0.0, -1.0, -0.5], requires_grad=True)
    sampled = torch.tensor([-math.log(8), -1.0 + math.log(4), -0.5])  # ratios 8, 1/4, 1
    inputs = {"logprobs": sampled, "advantages": torch.tensor([1.0, -2.0, 3.0])}
    loss, _ = datum_loss("cispo", logprobs_T, inputs, {})  # defaults: no lower bound, capped at 4
    assert loss.item() == pytest.approx(-(4 * 0.0 * 1.0 + 0.25 * -1.0 * -2.0 + 1.0 * -0.5 * 3.0))
    loss.backward()
    assert logprobs_T.grad.tolist() == pytest.approx([-4.0, 0.5, -3.0])  # -clip(r) * A: never zeroed
    loss, _ = datum_loss("cispo", logprobs_T.detach(), inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2})
    assert loss.item() == pytest.approx(-(2 * 0.0 + 0.5 * -1.0 * -2.0 + 1.0 * -0.5 * 3.0))


def test_dro_is_the_advantage_weighted_logprob_less_a_quadratic_penalty_on_the_gap():
    logprobs_T = torch.tensor([-1.0, -2.0], requires_grad=True)
    inputs = {"logprobs": torch.tensor([-1.5, -2.0]), "advantages": torch.tensor([2.0, -1.0])}
    loss, _ = datum_loss("dro", logprobs_T, inputs, {"beta": 0.4})
    assert loss.item() == pytest.approx(-((-1.0 * 2.0 - 0.2 * 0.25) + (-2.0 * -1.0 - 0.0)))
    loss.backward()
    assert logprobs_T.grad.tolist() == pytest.approx([-(2.0 - 0.4 * 0.5), -(-1.0)])
    default, _ = datum_loss("dro", logprobs_T.detach(), inputs, {})
    assert default.item() == pytest.approx(-((-2.0 - 0.025 * 0.25) + 2.0), abs=1e-6)  # float32 sums


def test_missing_or_misshapen_inputs_and_unserved_losses_say_what_to_send():
    with pytest.raises(LossInputError, match="'advantages' is missing"):
        datum_loss("ppo", torch.zeros(2), {"logprobs": torch.zeros(2)}, {})
    with pytest.raises(LossInputError, match="3 values for 2 target tokens"):
        datum_loss("cross_entropy", torch.zeros(2), {"weights": torch.zeros(3)}, {})
    with pytest.raises(LossInputError, match="cross_entropy, importance_sampling, ppo, cispo, dro"):
        check_loss("gspo")


def test_ids_of_any_shape_make_bucket_keys_and_a_retried_request_gets_the_same_id():
    model_id = "0123abcd:train:0"
    assert wire.request_id(model_id, 7) == wire.request_id(model_id, 7) == "0123abcd:train:0:7"
    key = wire.key("model", model_id, "alice")
    assert key.startswith("model.alice.") and all(c.isalnum() or c in "._" for c in key)
    assert wire.key("model", model_id, "bob") != key  # another tenant's read finds nothing
    assert wire.bucket_of("future") != wire.bucket_of("model")
