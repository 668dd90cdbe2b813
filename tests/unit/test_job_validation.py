"""Job validation as pure functions (``services.manager.validation``): no broker, no store, no tokenizer.

The stack's facts are given as values, the tokenizer as a word counter, and the task as built
(a toy task, or a stand-in with the attributes validation reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from marlaas.platform import limits
from marlaas.platform.api import SubmitError, parse_submission
from marlaas.tasks import TaskError, get_task
from services.manager import validation
from services.manager.validation import StackFacts

LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
FACTS = StackFacts(max_model_len=512, max_lora_rank=64, lora_targets=LORA_TARGETS, token_chars=10,
                   kv_bytes_per_token=1024, kv_budget_bytes=2**30)


def words(texts: list[str]) -> list[int]:
    """A stand-in tokenizer's counts: one token per word."""
    return [len(text.split()) for text in texts]


def submission(**fields):
    return parse_submission({"task": "addition", "steps": 2, "tenant": "acme", **fields})


def agentic(**attributes) -> SimpleNamespace:
    """A stand-in task with what the tool check reads."""
    return SimpleNamespace(**{"name": "agent", "kind": "agentic", "needs_tools": True, "has_reward": False,
                              **attributes})


# --- the fields' bounds ---------------------------------------------------------------------


def test_a_submission_within_bounds_has_no_problems():
    assert validation.field_problems(submission(), FACTS) == []


@pytest.mark.parametrize("fields, message", [
    ({"steps": 0}, f"steps must be between 1 and {limits.MAX_STEPS}"),
    ({"steps": limits.MAX_STEPS + 1}, "steps must be between 1"),
    ({"seed": -1}, "seed must be between 0 and"),
    ({"tenant": "Acme"}, "tenant must be lowercase letters"),
    ({"name": "n" * 65}, "name must be at most 64 characters"),
    ({"grpo": {"group_size": 1}}, "grpo.group_size must be at least 2"),
    ({"grpo": {"prompts_per_step": limits.MAX_PROMPTS_PER_STEP + 1}}, "grpo.prompts_per_step must be"),
    ({"grpo": {"temperature": 0.0}}, "grpo.temperature must be in [0.05, 5.0]"),
    ({"grpo": {"learning_rate": 1.0}}, "grpo.learning_rate must be in (0, 1)"),
    ({"grpo": {"kl_coef": -0.1}}, "grpo.kl_coef must be >= 0"),
    ({"grpo": {"truncated": "dorp"}}, "grpo.truncated must be one of"),
    ({"grpo": {"pipeline": "streams"}}, "grpo.pipeline must be one of groups, batch"),
    ({"grpo": {"max_staleness": 5}}, "grpo.max_staleness must be between 0 and 4"),
    ({"grpo": {"max_staleness": -1}}, "grpo.max_staleness must be between 0 and 4"),
    ({"grpo": {"ignore_eos": True, "truncated": "drop"}}, "with it, grpo.truncated must be 'train'"),
    ({"grpo": {"max_new_tokens": -1}}, "grpo.max_new_tokens must be >= 0"),
    ({"lora": {"rank": 65}}, "lora.rank must be between 1 and 64 (rollout.max_lora_rank)"),
    ({"lora": {"alpha": 0}}, "lora.alpha must be between 1 and"),
    ({"lora": {"dropout": 0.1}}, "lora.dropout must be 0 for RL jobs"),
    ({"lora": {"target_modules": []}}, "lora.target_modules must name at least one module"),
    ({"lora": {"target_modules": ["q_proj", "lm_head"]}}, "lora.target_modules ['lm_head'] are not linear"),
    ({"eval_problems": 0}, "eval_problems must be between 1 and 1000"),
    ({"eval_dataset": "held-out.jsonl"}, "eval_dataset is set but eval_every is 0"),
    ({"idempotency_key": "k" * 129}, "idempotency_key must be at most 128 characters"),
    ({"system": "s" * 5121}, "system is 5121 characters: no more than 5120 can fit"),
])
def test_each_bound_names_its_field(fields, message):
    (problem,) = validation.field_problems(submission(**fields), FACTS)
    assert message in problem


def test_every_field_problem_is_reported_at_once_in_one_error():
    request = submission(steps=0, tenant="Acme", grpo={"group_size": 1})
    assert len(validation.field_problems(request, FACTS)) == 3
    with pytest.raises(SubmitError, match="tenant must be .*; steps must be .*; grpo.group_size must be"):
        validation.validate_submission(request, FACTS, lambda dataset: get_task("addition"), words, 0.0)


def test_a_submission_with_bad_fields_reads_no_data():
    def no_data(dataset):
        raise AssertionError("read the data of a submission whose fields were refused")

    with pytest.raises(SubmitError, match="steps must be"):
        validation.validate_submission(submission(steps=0), FACTS, no_data, words, 0.0)


# --- tools and rewards ----------------------------------------------------------------------


@pytest.mark.parametrize("fields, tools, message", [
    ({}, (), "task 'agent' needs 'tools'"),
    ({}, ("acme.lookup",), "task 'agent' needs 'reward': a built-in one (judge, exact, contains, numeric)"),
    ({"reward": "fuzzy"}, ("acme.lookup",), "reward 'fuzzy': name your reward function as 'acme.<name>'"),
    ({"reward": "contains"}, ("other.lookup",), "'other.lookup' belongs to tenant 'other'"),
    ({"reward": "other.judge"}, ("acme.lookup",), "'other.judge' belongs to tenant 'other'"),
])
def test_tool_and_reward_names_are_checked_against_the_task_and_tenant(fields, tools, message):
    assert message in validation.tool_problem(submission(**fields), agentic(), tools)


def test_allowed_tools_and_rewards_have_no_problem():
    assert validation.tool_problem(submission(reward="contains"), agentic(), ("acme.lookup", "builtin.calc")) == ""
    assert validation.tool_problem(submission(reward="acme.judge"), agentic(), ("calc",)) == ""
    assert validation.tool_problem(submission(), get_task("addition"), ()) == ""


def test_a_single_turn_task_takes_no_tools():
    problem = validation.tool_problem(submission(), get_task("addition"), ("calc",))
    assert problem.startswith("task 'addition' is single-turn: it cannot call tools")


# --- token fit and footprint ----------------------------------------------------------------


def test_the_generation_budget_must_leave_room_for_a_prompt():
    assert validation.generation_problem(511, 512) == ""
    assert "grpo.max_new_tokens (512) leaves no room for the prompt" in validation.generation_problem(512, 512)


def test_a_prompt_that_does_not_fit_with_the_generation_budget_is_refused():
    task = SimpleNamespace(**{**vars(agentic(kind="single-turn", needs_tools=False, has_reward=True)),
                              "max_new_tokens": 8, "tools": (),
                              "longest_prompts": lambda: ["one two three", "w " * 600],
                              "max_episode_tokens": lambda n: n})
    with pytest.raises(SubmitError, match=r"dataset row 2 .*\(600 tokens\) \+ grpo.max_new_tokens \(8\)"):
        validation.job_record(submission(), task, FACTS, words, 0.0)


def test_the_footprint_is_every_sequence_of_the_batch_at_its_longest():
    grpo = submission(grpo={"prompts_per_step": 4, "group_size": 8}).grpo
    assert validation.kv_footprint(grpo, prompt_tokens=10, episode_tokens=6, kv_bytes_per_token=100) == 4 * 8 * 16 * 100


def test_a_staleness_job_holds_a_batch_of_each_version_it_may_serve_at_once():
    grpo = submission(grpo={"prompts_per_step": 4, "group_size": 8, "max_staleness": 2}).grpo
    footprint = validation.kv_footprint(grpo, prompt_tokens=10, episode_tokens=6, kv_bytes_per_token=100)
    assert footprint == 3 * 4 * 8 * 16 * 100
    task = get_task("addition")
    one = validation.validate_submission(submission(), FACTS, lambda dataset: task, words, 0.0).kv_cache_bytes
    fits = StackFacts(**{**vars(FACTS), "kv_budget_bytes": 2 * one})
    validation.validate_submission(submission(grpo={"max_staleness": 1}), fits, lambda dataset: task, words, 0.0)
    with pytest.raises(SubmitError, match="more than the whole budget .* or grpo.max_staleness"):
        validation.validate_submission(submission(grpo={"max_staleness": 2}), fits, lambda dataset: task, words, 0.0)


def test_a_job_larger_than_the_whole_budget_is_refused():
    assert validation.footprint_problem(2**20, 2**20) == ""
    problem = validation.footprint_problem(3 * 2**20, 2**20)
    assert problem.startswith("the job's rollout needs ~3.0 MiB of KV cache, more than the whole budget (1.0 MiB")
    small = StackFacts(**{**vars(FACTS), "kv_budget_bytes": 1024})
    with pytest.raises(SubmitError, match="more than the whole budget"):
        validation.validate_submission(submission(), small, lambda dataset: get_task("addition"), words, 0.0)


# --- the record built -----------------------------------------------------------------------


def test_the_record_resolves_the_tasks_budget_and_tools_and_sizes_the_footprint():
    task = get_task("addition")
    request = submission(name="My Job!", seed=7, grpo={"prompts_per_step": 2, "group_size": 4})
    record = validation.validate_submission(request, FACTS, lambda dataset: task, words, now=123.0)
    spec = record.spec
    assert spec.id.startswith("acme.my-job-") and spec.name == "My Job!" and spec.tenant == "acme"
    assert spec.grpo.max_new_tokens == task.max_new_tokens and spec.tools == task.tools
    assert spec.seed == 7 and spec.steps == 2 and spec.submitted_at == 123.0 and spec.lora == request.lora
    prompt_tokens = max(words(task.longest_prompts()))
    assert record.kv_cache_bytes == 2 * 4 * (prompt_tokens + task.max_new_tokens) * FACTS.kv_bytes_per_token


def test_a_task_error_is_the_submitters_and_names_the_held_out_data():
    def load(dataset):
        if dataset == "missing.jsonl":
            raise TaskError("missing.jsonl does not exist")
        return get_task("addition")

    with pytest.raises(SubmitError, match="^missing.jsonl does not exist$"):
        validation.validate_submission(submission(dataset="missing.jsonl"), FACTS, load, words, 0.0)
    request = submission(eval_every=1, eval_dataset="missing.jsonl")
    with pytest.raises(SubmitError, match="^eval_dataset: missing.jsonl does not exist$"):
        validation.validate_submission(request, FACTS, load, words, 0.0)


def test_the_name_and_slug_default_to_the_task():
    assert validation.job_name(submission()) == ("addition", "addition")
    assert validation.job_name(submission(name="  ")) == ("addition", "addition")
    assert validation.job_name(submission(name="!!!")) == ("!!!", "job")


def test_an_idempotency_key_gives_the_same_job_id_and_none_a_fresh_one():
    assert validation.job_id("acme", "run", "k1") == validation.job_id("acme", "run", "k1")
    assert validation.job_id("acme", "run", "k1") != validation.job_id("acme", "run", "k2")
    assert validation.job_id("acme", "run", "k1") != validation.job_id("zeta", "run", "k1").replace("zeta", "acme")
    assert validation.job_id("acme", "run") != validation.job_id("acme", "run")
    assert validation.job_id("acme", "run", "k1").startswith("acme.run-")


# --- sft jobs ---------------------------------------------------------------------------------


def sft_rows(tmp_path, *calls: str) -> str:
    import json

    path = tmp_path / "sft.jsonl"
    rows = [{"messages": [{"role": "user", "content": "capital of Zarvex?"},
                          {"role": "assistant", "tool_calls": [
                              {"type": "function", "function": {"name": name, "arguments": {"country": "Zarvex"}}}]},
                          {"role": "tool", "content": "Quorrin"}, {"role": "assistant", "content": "Quorrin"}]}
            for name in calls]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fields, message", [
    ({"sft": {"batch_size": 0}}, "sft.batch_size must be between 1"),
    ({"sft": {"epochs": -1}}, "sft.epochs must be between 0"),
    ({"grpo": {"max_staleness": 1}}, "nothing is sampled: drop grpo.max_staleness"),
    ({"eval_every": 2}, "drop eval_every"),
])
def test_an_sft_jobs_own_bounds(fields, message):
    problems = validation.field_problems(submission(task="sft", **fields), FACTS)
    assert any(message in p for p in problems), problems


def test_an_sft_job_takes_its_steps_from_epochs_and_needs_no_group(tmp_path):
    data = sft_rows(tmp_path, *["zorbleck_capital"] * 6)
    request = submission(task="sft", dataset=data, tools=["acme.zorbleck_capital"], sft={"batch_size": 4, "epochs": 2})
    assert validation.field_problems(request, FACTS) == []
    record = validation.job_record(request, get_task("sft", data), FACTS, words, now=0.0)
    assert record.spec.steps == 3 and record.spec.grpo.prompts_per_step == 4 and record.kv_cache_bytes == 0


def test_an_sft_row_calling_a_tool_the_job_does_not_name_is_refused_with_its_line(tmp_path):
    data = sft_rows(tmp_path, "zorbleck_capital", "zorbleck_moons")
    request = submission(task="sft", dataset=data, tools=["acme.zorbleck_capital"])
    with pytest.raises(SubmitError, match=r"sft.jsonl:2: a call names tool 'zorbleck_moons'.*add it to 'tools'"):
        validation.job_record(request, get_task("sft", data), FACTS, words, now=0.0)
