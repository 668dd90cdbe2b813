"""The Tinker API's losses (services/trainer/tinker_losses.py): Tinker's formulations, per datum."""

from __future__ import annotations

import math

import pytest
import torch

from marlaas.platform import tinker_records as wire
from services.trainer.tinker_losses import LossInputError, check_loss, datum_loss, provenance_inputs


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
    assert logprobs_T.grad.tolist() == pytest.approx([-(2.0 - 0.4 * 0.5), -(-1.0 - 0.0)])
    default, _ = datum_loss("dro", logprobs_T.detach(), inputs, {})
    assert default.item() == pytest.approx(-((-2.0 - 0.025 * 0.25) + 2.0), abs=1e-6)  # float32 sums


def test_stable_reinforce_trains_only_sampled_tokens_on_the_recorded_logprobs_with_a_truncated_weight():
    logprobs_T = torch.tensor([-0.3, 0.0, -1.0, -0.5], requires_grad=True)
    recorded = torch.tensor([0.0, -math.log(8), -1.0 + math.log(2), -0.5])  # ratios -, 8, 1/2, 1
    inputs = {"advantages": torch.tensor([5.0, 1.0, -2.0, 3.0]), "recorded_logprobs": recorded,
              "recorded_mask": torch.tensor([0.0, 1.0, 1.0, 1.0])}  # position 0: a prompt token
    loss, _ = datum_loss("stable_reinforce", logprobs_T, inputs, {})  # cap 2, no KL term
    assert loss.item() == pytest.approx(-(2 * 0.0 * 1.0 + 0.5 * -1.0 * -2.0 + 1.0 * -0.5 * 3.0))
    loss.backward()
    assert logprobs_T.grad.tolist() == pytest.approx([0.0, -2.0, 1.0, -3.0])  # -min(r, 2) * A, masked
    # the k3 KL term: exp(q - lp) - (q - lp) - 1 per sampled token, times kl_coeff
    with_kl, _ = datum_loss("stable_reinforce", logprobs_T.detach(), inputs, {"kl_coeff": 0.1,
                                                                               "clip_high_threshold": 4})
    k3 = sum(math.exp(g) - g - 1 for g in (-math.log(8), math.log(2), 0.0))
    assert with_kl.item() == pytest.approx(-(0.0 + 0.5 * -1.0 * -2.0 - 1.5) + 0.1 * k3, abs=1e-5)


def test_gspo_clips_one_sequence_level_ratio_and_weighs_a_sequence_once():
    logprobs_T = torch.tensor([0.0, -1.0, -0.5], requires_grad=True)
    inputs = {"logprobs": torch.tensor([-0.1, -1.0, -0.2]), "advantages": torch.tensor([5.0, 2.0, 2.0]),
              "sequence_ratio_mask": torch.tensor([0.0, 1.0, 1.0])}  # position 0: the prompt's
    ratio = math.exp((0.0 + -0.3) / 2)  # the mean log-ratio over the mask
    loss, _ = datum_loss("gspo", logprobs_T, inputs, {})  # unclipped side: r * A < clip(r) * A
    assert loss.item() == pytest.approx(-ratio * 2.0)
    loss.backward()
    assert logprobs_T.grad.tolist() == pytest.approx([0.0, -ratio, -ratio])  # -A * r / |mask| each
    above = {**inputs, "logprobs": torch.tensor([0.0, -1.2, -0.7])}  # r = e^0.2, over 1 + 0.05
    clipped, _ = datum_loss("gspo", logprobs_T.detach(), above, {"clip_low_threshold": 0.95,
                                                                 "clip_high_threshold": 1.05})
    assert clipped.item() == pytest.approx(-1.05 * 2.0)
    no_mask, _ = datum_loss("gspo", torch.zeros(2), {"logprobs": torch.zeros(2), "advantages": torch.ones(2)}, {})
    assert no_mask.item() == pytest.approx(-1.0)  # every token, weighed once in all


def test_provenance_names_recorded_sequences_and_a_mismatch_or_a_missing_one_is_refused():
    record = wire.SequenceRecord(id="s:1:0", tenant="alice", prompt=[5, 6, 7], tokens=[8, 9],
                                 logprobs=[-0.25, -0.75])
    targets_T = torch.tensor([6, 7, 8, 9])  # the prompt from its second token, then the sampled ones
    spans = [("prompt", "s:1:0", 1, 2), ("sampled", "s:1:0", 0, 2)]
    got = provenance_inputs(0, targets_T, spans, {"s:1:0": record})
    assert got["recorded_mask"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert got["recorded_logprobs"].tolist() == [0.0, 0.0, -0.25, -0.75]
    with pytest.raises(LossInputError, match="not tokens 0..1 of sequence 's:1:0'"):
        provenance_inputs(3, torch.tensor([6, 7, 8, 4]), spans, {"s:1:0": record})
    with pytest.raises(LossInputError, match="no recorded sequence 's:1:0' of yours"):
        provenance_inputs(0, targets_T, spans, {})
    with pytest.raises(LossInputError, match="cover 3 positions"):
        provenance_inputs(0, targets_T, spans[:1] + [("sampled", "s:1:0", 0, 1)], {"s:1:0": record})
    with pytest.raises(LossInputError, match="needs provenance"):
        provenance_inputs(0, targets_T, [], {"s:1:0": record})


def test_missing_or_misshapen_inputs_and_unserved_losses_say_what_to_send():
    with pytest.raises(LossInputError, match="'advantages' is missing"):
        datum_loss("ppo", torch.zeros(2), {"logprobs": torch.zeros(2)}, {})
    with pytest.raises(LossInputError, match="3 values for 2 target tokens"):
        datum_loss("cross_entropy", torch.zeros(2), {"weights": torch.zeros(3)}, {})
    with pytest.raises(LossInputError, match="ppo, cispo, dro, stable_reinforce, gspo"):
        check_loss("dapo")


def test_ids_of_any_shape_make_bucket_keys_and_a_retried_request_gets_the_same_id():
    model_id = "0123abcd:train:0"
    assert wire.request_id(model_id, 7) == wire.request_id(model_id, 7) == "0123abcd:train:0:7"
    key = wire.key("model", model_id, "alice")
    assert key.startswith("model.alice.") and all(c.isalnum() or c in "._" for c in key)
    assert wire.key("model", model_id, "bob") != key  # another tenant's read finds nothing
    assert wire.bucket_of("future") != wire.bucket_of("model")
