"""The trainer's model with real torch + peft on the built-in base: v0 init, GRPO steps, resume."""

import math

import pytest
import torch
from safetensors.torch import load as load_safetensors

from marlaas.adapters import init_adapter
from marlaas.basemodel import builtin_model_dir
from marlaas.events import GrpoSettings, LoraSettings, Sample, TrajectoryBatch
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer

SETTINGS = GrpoSettings(learning_rate=1e-2)


@pytest.fixture(scope="module")
def base_dir():
    return builtin_model_dir()


@pytest.fixture(scope="module")
def v0(base_dir):
    return init_adapter(base_dir, LoraSettings(), seed=7)


def batch(rewards: list[float]) -> TrajectoryBatch:
    """One group: the same prompt, a different one-to-three-token completion each."""
    completions = [[5 + i, 6 + i, 1][: 1 + i % 3] for i in range(len(rewards))]
    return TrajectoryBatch(samples=[
        Sample(group=0, prompt_ids=[10, 11, 12], completion_ids=c, logprobs=[0.0] * len(c),
               loss_mask=[1] * len(c), reward=r)
        for c, r in zip(completions, rewards)
    ])


def sequence_logprob(trainer: PolicyTrainer, job: str, sample: Sample) -> float:
    trainer.model.set_adapter(trainer.hot[job].slot)
    tokens = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(trainer.model(input_ids=tokens).logits[0, :-1], -1)
    p = len(sample.prompt_ids)
    return sum(logp[p - 1 + t, tok].item() for t, tok in enumerate(sample.completion_ids))


def test_version_zero_is_seeded_and_leaves_the_base_unchanged(base_dir, v0):
    config_json, weights = v0
    assert init_adapter(base_dir, LoraSettings(), seed=7)[1] == weights
    assert init_adapter(base_dir, LoraSettings(), seed=8)[1] != weights
    tensors = load_safetensors(weights)
    assert all(t.abs().sum() == 0 for k, t in tensors.items() if "lora_B" in k)
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_A" in k)


def test_grpo_steps_raise_the_rewarded_completion(base_dir, v0):
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    data = batch([1.0, 0.0, 0.0, 0.0])
    before = sequence_logprob(trainer, "t.job", data.samples[0])
    for _ in range(5):
        result = trainer.train_step("t.job", data, SETTINGS)
    after = sequence_logprob(trainer, "t.job", data.samples[0])
    assert after > before
    assert trainer.hot_version("t.job") == 5
    assert math.isfinite(result.metrics["loss"]) and result.metrics["reward/mean"] == 0.25


def test_a_cold_job_resumes_exactly_from_its_exported_state(base_dir, v0):
    first = PolicyTrainer(base_dir)
    first.load("t.job", 0, *v0, None, SETTINGS)
    step = first.train_step("t.job", batch([1.0, 0.0, 0.5, 0.0]), SETTINGS)
    second = PolicyTrainer(base_dir)
    second.load("t.job", 1, step.config_json, step.weights, step.optimizer_state, SETTINGS)
    again = first.train_step("t.job", batch([0.0, 1.0, 0.0, 0.5]), SETTINGS)
    resumed = second.train_step("t.job", batch([0.0, 1.0, 0.0, 0.5]), SETTINGS)
    a, b = load_safetensors(again.weights), load_safetensors(resumed.weights)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_non_finite_updates_are_refused(base_dir, v0):
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    with pytest.raises(NonFiniteUpdate, match="version 0"):
        trainer.train_step("t.job", batch([float("nan"), 0.0, 1.0, 0.0]), SETTINGS)


def test_jobs_keep_separate_adapters(base_dir, v0):
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.a", 0, *v0, None, SETTINGS)
    trainer.load("t.b", 0, *v0, None, SETTINGS)
    trainer.train_step("t.a", batch([1.0, 0.0, 0.0, 0.0]), SETTINGS)
    _, weights_a, _ = trainer.export("t.a")
    _, weights_b, _ = trainer.export("t.b")
    a, b, init = (load_safetensors(w) for w in (weights_a, weights_b, v0[1]))
    assert all(torch.equal(b[k], init[k]) for k in init)  # b untouched by a's step
    assert not all(torch.equal(a[k], init[k]) for k in init)


def test_an_absent_accelerator_is_a_clear_error():
    from services.trainer.policy import pick_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        pick_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grpo_step_on_cuda(base_dir, v0):
    trainer = PolicyTrainer(base_dir, device="cuda")
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    result = trainer.train_step("t.job", batch([1.0, 0.0, 0.0, 0.0]), SETTINGS)
    assert math.isfinite(result.metrics["loss"]) and trainer.hot_version("t.job") == 1
