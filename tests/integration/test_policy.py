"""The trainer's model with real torch + peft on the built-in base: v0 init, GRPO steps, resume,
micro-batching against a whole-batch reference, tempered scoring, non-finite updates."""

import json
import math

import msgspec
import pytest
import torch
from safetensors.torch import load as load_safetensors

from marlaas.basemodel import builtin_model_dir
from marlaas.platform.adapters import init_adapter
from marlaas.platform.events import GrpoSettings, LoraSettings, Sample, TrajectoryBatch
from services.trainer import policy
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer, find_decoder_and_head, torch_threads

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



def test_a_supervised_batch_trains_the_masked_cross_entropy_on_the_same_path(base_dir, v0):
    """``objective = "sft"``: the same samples, packing and step; the loss is the masked tokens'
    mean negative log-likelihood at T = 1 (computed by hand here on a two-row batch, with a
    masked-out token in each row), rewards and sampling logprobs unused, and steps raise it."""
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.sft", 0, *v0, None, SETTINGS)
    rows = [([10, 11, 5, 6, 7], [0, 0, 1, 0, 1]), ([12, 8, 9], [0, 1, 1])]
    data = TrajectoryBatch(objective="sft", samples=[
        Sample(group=i, prompt_ids=[], completion_ids=ids, logprobs=[], loss_mask=mask, reward=0.0)
        for i, (ids, mask) in enumerate(rows)])
    trainer.model.set_adapter(trainer.hot["t.sft"].slot)
    picked = []
    with torch.no_grad():
        for ids, mask in rows:
            logp = torch.log_softmax(trainer.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            picked += [logp[t - 1, ids[t]].item() for t in range(1, len(ids)) if mask[t]]
    by_hand = -sum(picked) / len(picked)  # 4 masked tokens over the batch

    first = trainer.train_step("t.sft", data, SETTINGS)
    assert first.metrics["loss"] == pytest.approx(by_hand, rel=1e-4)
    assert first.metrics["tokens"] == 4 and "reward/mean" not in first.metrics
    for _ in range(4):
        last = trainer.train_step("t.sft", data, SETTINGS)
    assert last.metrics["loss"] < first.metrics["loss"]


def test_a_batch_whose_every_episode_was_dropped_still_steps_without_a_reward(base_dir, v0):
    """grpo.truncated = "drop" can leave a version no sample: the step commits with no gradient
    and no reward figure (the manager records rewards only where there is one)."""
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    result = trainer.train_step("t.job", TrajectoryBatch(samples=[]), SETTINGS)
    assert trainer.hot_version("t.job") == 1
    assert "reward/mean" not in result.metrics and result.metrics["tokens"] == 0
    assert all(math.isfinite(v) for v in result.metrics.values())

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


def test_a_non_finite_gradient_is_refused(base_dir, v0):
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    data = batch([1.0, 0.0, 0.0, 0.0])
    first = data.samples[0]  # positive advantage: its clipped loss term stays finite, its gradient does not
    poisoned = msgspec.structs.replace(first, logprobs=[float("-inf")] + first.logprobs[1:])
    with pytest.raises(NonFiniteUpdate, match="gradient norm is nan at version 0"):
        trainer.train_step("t.job", TrajectoryBatch(samples=[poisoned, *data.samples[1:]]), SETTINGS)
    assert trainer.hot_version("t.job") == 0


def test_non_finite_weights_are_refused(base_dir, v0, monkeypatch):
    trainer = PolicyTrainer(base_dir)
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    hot = trainer.hot["t.job"]

    def overflowing_step():  # what an overflowing update does, with a finite gradient
        with torch.no_grad():
            hot.params[0].fill_(float("inf"))

    monkeypatch.setattr(hot.optimizer, "step", overflowing_step)
    with pytest.raises(NonFiniteUpdate, match="weights became non-finite after the step at version 0"):
        trainer.train_step("t.job", batch([1.0, 0.0, 0.0, 0.0]), SETTINGS)
    assert trainer.hot_version("t.job") == 0


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


def test_target_logprobs_of_padded_rows_are_each_rows_own_and_a_failed_requests_gradients_undo(base_dir, v0):
    """The Tinker API's scoring (services/trainer/tinker_training.py): rows of different lengths in one
    right-padded pass score as they do alone; gradients saved before a request come back after it."""
    trainer = PolicyTrainer(base_dir)
    trainer.load("tinker/m", 0, *v0, None, SETTINGS)
    rows = [(torch.tensor([5, 9, 11, 4, 7]), torch.tensor([9, 11, 4, 7, 2])),
            (torch.tensor([3, 8]), torch.tensor([8, 6]))]
    with torch.no_grad():
        together = trainer.target_logprobs("tinker/m", rows)
        alone = [trainer.target_logprobs("tinker/m", [row])[0] for row in rows]
    assert [t.shape[0] for t in together] == [5, 2]
    assert all(torch.allclose(t, a, atol=1e-5) for t, a in zip(together, alone))
    assert all((t < 0).all() for t in together)
    saved = trainer.gradients("tinker/m")
    sum(t.sum() for t in trainer.target_logprobs("tinker/m", rows)).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.hot["tinker/m"].params)
    trainer.restore_gradients("tinker/m", saved)
    assert all(p.grad is None for p in trainer.hot["tinker/m"].params)


def test_an_export_is_what_peft_saves_for_the_adapter(base_dir, v0, tmp_path):
    """The trainer names a hot job's tensors once at load; each export must still equal peft's own."""
    from peft.utils import get_peft_model_state_dict

    trainer = PolicyTrainer(base_dir)
    for job in ("t.a", "t.b", "t.c"):
        trainer.load(job, 0, *v0, None, SETTINGS)
    trainer.train_step("t.b", batch([1.0, 0.0, 0.0, 0.0]), SETTINGS)
    trainer.train_step("t.a", batch([0.0, 1.0, 0.0, 0.0]), SETTINGS)
    for job in ("t.a", "t.b", "t.c"):
        config_json, weights, _ = trainer.export(job)
        slot = trainer.hot[job].slot
        theirs = get_peft_model_state_dict(trainer.model, adapter_name=slot)
        ours = load_safetensors(weights)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        trainer.model.peft_config[slot].save_pretrained(tmp_path / job)
        assert config_json == (tmp_path / job / "adapter_config.json").read_bytes()
    assert trainer.model.active_adapter == trainer.hot["t.a"].slot  # the last trained


def test_the_hot_set_is_bounded_by_count_and_by_memory(base_dir, v0):
    """Least recently trained jobs leave first, when more are hot than the count or the memory allows."""
    by_count = PolicyTrainer(base_dir, hot_adapters=2)
    for job in ("t.a", "t.b", "t.c"):
        by_count.load(job, 0, *v0, None, SETTINGS)
    assert list(by_count.hot) == ["t.b", "t.c"]

    job_bytes = 4 * sum(p.numel() * p.element_size() for p in by_count.hot["t.c"].params)
    by_memory = PolicyTrainer(base_dir, hot_adapters=256, hot_memory_bytes=2 * job_bytes + job_bytes // 2)
    for job in ("t.a", "t.b", "t.c"):
        by_memory.load(job, 0, *v0, None, SETTINGS)
        by_memory.train_step(job, batch([1.0, 0.0, 0.0, 0.0]), SETTINGS)
    by_memory.load("t.a", 1, *by_memory.export("t.c")[:2], None, SETTINGS)  # t.b trained least recently
    assert list(by_memory.hot) == ["t.c", "t.a"]
    assert by_memory.hot_limit(by_memory.hot["t.a"].params) == 2
    assert PolicyTrainer(base_dir, hot_memory_bytes=1).hot_limit(by_memory.hot["t.a"].params) == 1  # always one


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


# --- micro-batching and tempered scoring against today's whole-batch math ------------------


def uneven_batch(trainer: PolicyTrainer, job: str, temperature: float) -> TrajectoryBatch:
    """Two groups, lengths 4..16, some masked-out tokens; sample logprobs near the policy's own."""
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(8):
        prompt = torch.randint(3, 128, (3 + 2 * (i % 2),), generator=gen).tolist()
        completion = torch.randint(3, 128, (1 + (5 * i) % 12,), generator=gen).tolist()
        mask = [0 if (i + t) % 5 == 4 else 1 for t in range(len(completion))]  # e.g. tool output
        samples.append(Sample(group=i % 2, prompt_ids=prompt, completion_ids=completion,
                              logprobs=[0.0] * len(completion), loss_mask=mask, reward=float((i * 7) % 5)))
    own = reference_logprobs(trainer, job, samples, temperature)
    noisy = [[lp + 0.3 * torch.randn((), generator=gen).item() for lp in lps] for lps in own]
    return TrajectoryBatch(samples=[msgspec.structs.replace(s, logprobs=lps) for s, lps in zip(samples, noisy)])


def pack(samples: list[Sample]):
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    tokens, attn, mask, sample_lp = (torch.zeros(len(samples), width) for _ in range(4))
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        tokens[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.float32)
        attn[i, : p + c] = 1
        mask[i, p : p + c] = torch.tensor(s.loss_mask, dtype=torch.float32)
        sample_lp[i, p : p + c] = torch.tensor(s.logprobs)
    return tokens.long(), attn.long(), mask, sample_lp


def full_logprobs(model, tokens, attn, temperature):
    """The whole batch in one forward, full fp32 log-softmax over the vocabulary."""
    logits = model(input_ids=tokens, attention_mask=attn).logits
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def reference_logprobs(trainer, job, samples, temperature) -> list[list[float]]:
    trainer.model.set_adapter(trainer.hot[job].slot)
    tokens, attn, _, _ = pack(samples)
    with torch.no_grad():
        lp = full_logprobs(trainer.model, tokens, attn, temperature)
    return [lp[i, len(s.prompt_ids): len(s.prompt_ids) + len(s.completion_ids)].tolist()
            for i, s in enumerate(samples)]


def reference_loss(trainer, job, data: TrajectoryBatch, settings: GrpoSettings) -> torch.Tensor:
    """Today's math, written out: one padded batch, token-mean clipped loss + kl_coef * token-mean k3."""
    model = trainer.model
    model.set_adapter(trainer.hot[job].slot)
    model.train()
    tokens, attn, mask, sample_lp = pack(data.samples)
    rewards = torch.tensor([s.reward for s in data.samples])
    groups = torch.tensor([s.group for s in data.samples])
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std(unbiased=False) + 1e-4) if settings.scale_by_std else r - r.mean()
    lp = full_logprobs(model, tokens, attn, settings.temperature)
    ratio = torch.exp((lp - sample_lp) * mask)
    eps = settings.clip_eps
    surrogate = torch.minimum(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    loss = -(surrogate * mask).sum() / mask.sum()
    if settings.kl_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = full_logprobs(model, tokens, attn, settings.temperature)
        delta = ref - lp
        loss = loss + settings.kl_coef * ((delta.exp() - delta - 1) * mask).sum() / mask.sum()
    return loss


@pytest.fixture(scope="module")
def perturbed(base_dir, v0):
    """A trainer whose job's LoRA is far from zero, so the adapter (and the KL) matter."""
    trainer = PolicyTrainer(base_dir, micro_batch_tokens=12)  # several micro-batches, some oversized rows
    trainer.load("t.job", 0, *v0, None, SETTINGS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.hot["t.job"].params:
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return trainer


def reference_gradients(trainer, job, data: TrajectoryBatch, settings: GrpoSettings):
    """``reference_loss`` and the gradients it gives the job's parameters (theirs cleared first)."""
    params = trainer.hot[job].params
    for p in params:
        p.grad = None
    expected = reference_loss(trainer, job, data, settings)
    expected.backward()
    return expected, [p.grad.clone() for p in params]


def assert_gradients_equal(params, expected_grads) -> None:
    worst = max((p.grad - g).abs().max().item() for p, g in zip(params, expected_grads))
    scale = max(g.abs().max().item() for g in expected_grads)
    assert scale > 1e-3  # the comparison is not vacuous
    assert worst < 1e-5 * max(1.0, scale)  # float32 summation order differs between the paths


@pytest.mark.parametrize("temperature,kl_coef,split_head", [
    (1.0, 0.0, True), (0.7, 0.0, True), (0.7, 0.2, True), (0.7, 0.2, False),
])
def test_micro_batched_loss_and_gradients_equal_the_whole_batch(perturbed, temperature, kl_coef, split_head):
    trainer, job = perturbed, "t.job"
    settings = GrpoSettings(temperature=temperature, kl_coef=kl_coef)
    data = uneven_batch(trainer, job, temperature)
    params = trainer.hot[job].params
    expected, expected_grads = reference_gradients(trainer, job, data, settings)

    trainer.split_head = split_head
    try:
        got = trainer.accumulate_gradients(job, data, settings)
    finally:
        trainer.split_head = True
    assert abs(got["loss"] - expected.item()) < 1e-5 * max(1.0, abs(expected.item()))  # float32 sums, as below
    assert got["tokens"] == sum(sum(s.loss_mask) for s in data.samples)
    assert 0 < got["clip_fraction"] < 1 and (got["kl"] > 0) == (kl_coef > 0)
    assert_gradients_equal(params, expected_grads)


@pytest.mark.parametrize("temperature,kl_coef", [(1.0, 0.0), (0.7, 0.0), (1.0, 0.2), (0.7, 0.2)])
def test_the_pipelined_loss_and_gradients_equal_the_whole_batch(perturbed, temperature, kl_coef):
    """grpo.pipeline = "groups": each group's gradients are added as it arrives (last group first
    here), and the step divides by the batch's token count only then; loss, metrics and gradients
    are the whole batch's (today's math, ``reference_loss``)."""
    trainer, job = perturbed, "t.job"
    settings = GrpoSettings(temperature=temperature, kl_coef=kl_coef)
    data = uneven_batch(trainer, job, temperature)
    params = trainer.hot[job].params
    expected, expected_grads = reference_gradients(trainer, job, data, settings)
    whole = trainer.accumulate_gradients(job, data, settings)

    trainer.begin_batch(job)
    arrivals = sorted({s.group for s in data.samples}, reverse=True)
    assert len(arrivals) > 1
    for group in arrivals:
        trainer.add_groups(job, [s for s in data.samples if s.group == group], settings)
        assert trainer.accumulated(job).groups >= {group}
    got, accumulated = trainer.finish_gradients(job)
    assert accumulated.groups == set(arrivals) and trainer.accumulated(job) is None
    assert abs(got["loss"] - expected.item()) < 1e-5 * max(1.0, abs(expected.item()))
    assert got["tokens"] == whole["tokens"] == sum(sum(s.loss_mask) for s in data.samples)
    for key in ("clip_fraction", "kl", "logprob_gap", "tokens_scored"):
        assert got[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert (got["kl"] > 0) == (kl_coef > 0)
    assert_gradients_equal(params, expected_grads)


def test_a_step_needs_a_batch_begun(perturbed):
    with pytest.raises(RuntimeError, match="before begin_batch"):
        perturbed.add_groups("t.job", [], GrpoSettings())


def test_the_trainer_scores_the_tempered_policy(perturbed):
    trainer, job = perturbed, "t.job"
    data = uneven_batch(trainer, job, 0.7)
    engine_logprobs = reference_logprobs(trainer, job, data.samples, 0.7)  # what the engine reports at T=0.7
    on_policy = TrajectoryBatch(samples=[msgspec.structs.replace(s, logprobs=lps)
                                         for s, lps in zip(data.samples, engine_logprobs)])
    at_sampling_t = trainer.accumulate_gradients(job, on_policy, GrpoSettings(temperature=0.7))
    at_t1 = trainer.accumulate_gradients(job, on_policy, GrpoSettings(temperature=1.0))
    assert at_sampling_t["logprob_gap"] < 1e-5 and at_sampling_t["clip_fraction"] == 0.0
    assert at_t1["logprob_gap"] > 1e-2


def test_the_decoder_and_head_are_found_through_peft(perturbed):
    decoder, head = find_decoder_and_head(perturbed.model)
    assert head is perturbed.base.get_output_embeddings()
    assert any("lora_A" in name for name, _ in decoder.named_parameters())  # the adapter lives inside
    assert perturbed.split_head


def test_a_group_of_equal_rewards_is_not_run_and_the_gradients_are_unchanged(perturbed):
    """Without a KL term, equal rewards give advantages of exactly 0: their samples add nothing to
    the loss or the gradients, so the trainer skips their forward/backward; N stays the batch's."""
    trainer, job = perturbed, "t.job"
    data = uneven_batch(trainer, job, 1.0)
    samples = [msgspec.structs.replace(s, reward=1.0) if s.group == 1 else s for s in data.samples]
    data = TrajectoryBatch(samples=samples)
    params = trainer.hot[job].params
    for p in params:
        p.grad = None
    expected = reference_loss(trainer, job, data, SETTINGS)  # every sample run, the equal group's adv 0
    expected.backward()
    expected_grads = [p.grad.clone() for p in params]

    run: list[int] = []
    original = trainer._micro_batch_loss
    trainer._micro_batch_loss = lambda rows, *args: (run.extend(s.group for s in rows), original(rows, *args))[1]
    try:
        got = trainer.accumulate_gradients(job, data, GrpoSettings(temperature=1.0))
    finally:
        del trainer._micro_batch_loss
    assert sorted(run) == [0, 0, 0, 0]  # only the group with a signal went through the model
    assert got["tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert got["tokens_scored"] == sum(sum(s.loss_mask) for s in samples if s.group == 0)
    assert abs(got["loss"] - expected.item()) < 1e-5 * max(1.0, abs(expected.item()))  # float32 sums, as below
    worst = max((p.grad - g).abs().max().item() for p, g in zip(params, expected_grads))
    scale = max(g.abs().max().item() for g in expected_grads)
    assert scale > 1e-3 and worst < 1e-5 * scale


def test_the_fused_lora_layers_match_peft(perturbed):
    """The trainer's LoRA layers fold the adapter's scale-and-add into one addmm: same logits and
    gradients as peft's own layer (swapped back in for the comparison)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    from services.trainer.fused_lora import FusedLoraLinear

    trainer, job = perturbed, "t.job"
    layers = [m for m in trainer.model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(type(m) is FusedLoraLinear for m in layers)
    data = uneven_batch(trainer, job, 1.0)
    tokens, attn, _, _ = pack(data.samples)
    params = trainer.hot[job].params
    trainer.model.set_adapter(trainer.hot[job].slot)

    def logits_and_grads():
        for p in params:
            p.grad = None
        logits = trainer.model(input_ids=tokens, attention_mask=attn).logits
        (logits * attn[..., None]).square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in params]

    fused_logits, fused_grads = logits_and_grads()
    for m in layers:
        m.__class__ = LoraLinear
    try:
        peft_logits, peft_grads = logits_and_grads()
        with trainer.model.disable_adapter():  # the fallback path: peft's own forward, the base alone
            base_logits = trainer.model(input_ids=tokens, attention_mask=attn).logits
    finally:
        for m in layers:
            m.__class__ = FusedLoraLinear
    with torch.no_grad(), trainer.model.disable_adapter():
        assert torch.equal(trainer.model(input_ids=tokens, attention_mask=attn).logits, base_logits)
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter matters here
    assert torch.allclose(fused_logits, peft_logits, atol=1e-5)
    for f, p in zip(fused_grads, peft_grads):
        assert torch.allclose(f, p, atol=1e-6, rtol=1e-4)


def test_the_trainer_leaves_the_engine_a_core_only_when_it_trains_beside_it(monkeypatch):
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 4)
    assert torch_threads(0, "cpu", beside_engine=True) == 3  # async: one job trains while others generate
    assert torch_threads(0, "cpu", beside_engine=False) == 4  # sync, sequential: the engine idles meanwhile
    assert torch_threads(2, "cpu", beside_engine=False) == 2  # a configured count is kept
    assert torch_threads(0, "cuda", beside_engine=True) == 0  # torch's own default off the CPU
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 1)
    assert torch_threads(0, "cpu", beside_engine=True) == 1


# --- the shared base: no job changes it (issue 48, item 1) -----------------------------------


def test_the_base_digest_is_the_same_with_adapters_attached_trained_and_dropped(base_dir, v0):
    """The digest covers the base's own tensors: attaching a job's LoRA (peft wraps the layers),
    stepping it and evicting it leave it as taken at load."""
    trainer = PolicyTrainer(base_dir)
    loaded = trainer.base_digest
    trainer.load("acme.a", 0, *v0, None, SETTINGS)
    trainer.load("acme.b", 0, *v0, None, SETTINGS)
    trainer.train_step("acme.a", batch([1.0, 0.0]), SETTINGS)
    assert not trainer.base_changed() and trainer.base_digest == loaded
    trainer.evict("acme.a")
    assert not trainer.base_changed()
    assert PolicyTrainer(base_dir).base_digest == loaded  # the same weights from disk: the same digest


def test_an_adapter_asking_for_pissa_init_changes_neither_the_base_nor_another_jobs_logprobs(base_dir, v0):
    """Issue 48 H2: an adapter config with ``init_lora_weights = "pissa"`` once made peft rewrite
    the shared base in the trainer, and every tenant trained off-policy. Its config is reduced to
    its shape: loading and training it leaves the base's digest and alice's logprobs as they were."""
    trainer = PolicyTrainer(base_dir)
    trainer.load("alice.job", 0, *v0, None, SETTINGS)
    probe = batch([1.0]).samples[0]
    before = sequence_logprob(trainer, "alice.job", probe)
    config_json, weights = v0
    for init in ("pissa", "olora", "pissa_niter_4"):
        hostile = json.dumps(json.loads(config_json) | {"init_lora_weights": init}).encode()
        trainer.load(f"mallory.{init}", 0, hostile, weights, None, SETTINGS)
        trainer.train_step(f"mallory.{init}", batch([1.0, 0.0]), SETTINGS)
    assert not trainer.base_changed()
    assert sequence_logprob(trainer, "alice.job", probe) == before


def test_a_base_changed_in_place_is_seen_and_reloaded_as_it_was(base_dir, v0):
    """Whatever changed the base (the check does not depend on how), the digest sees it, and a
    reload gives the base as on disk again: every hot job dropped, to be loaded from the store."""
    trainer = PolicyTrainer(base_dir)
    trainer.load("alice.job", 0, *v0, None, SETTINGS)
    probe = batch([1.0]).samples[0]
    before = sequence_logprob(trainer, "alice.job", probe)
    with torch.no_grad():
        next(p for n, p in trainer.base.named_parameters() if "base_layer" in n).add_(0.05)
    assert trainer.base_changed()
    assert sequence_logprob(trainer, "alice.job", probe) != before
    assert trainer.reload_base() == ["alice.job"]
    assert not trainer.base_changed() and trainer.hot_version("alice.job") is None
    trainer.load("alice.job", 0, *v0, None, SETTINGS)
    assert sequence_logprob(trainer, "alice.job", probe) == before
