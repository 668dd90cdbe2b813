"""A job's follow-up (``then``): parsed and checked with the job, its data checked like the job's,
the submission that starts it, and ``marlaas submit --then``."""

import pytest

from marlaas.cli.commands import build_parser
from marlaas.cli.job_commands import submission_from_args
from marlaas.platform.api import MAX_THEN_CHAIN, SubmitError, follow_up, follow_up_tree, parse_submission
from marlaas.sdk.http import read_job_file
from services.gateway.submission import SubmissionRefused, check_submission

SFT = {"name": "warm", "task": "sft", "steps": 1, "dataset": "file-aaa", "tenant": "acme"}
RL = {"name": "rl", "task": "agent", "steps": 20, "dataset": "file-bbb", "reward": "contains"}


def test_a_follow_up_is_parsed_as_its_tenants_submission():
    job = parse_submission({**SFT, "then": RL})
    follow = follow_up(job)
    assert (follow.task, follow.steps, follow.tenant, follow.dataset) == ("agent", 20, "acme", "file-bbb")
    assert follow_up(follow) is None


@pytest.mark.parametrize("then, message", [
    ({**RL, "stpes": 3}, "unknown field 'then.stpes'"),
    ({**RL, "grpo": {"group_sise": 4}}, "unknown field 'then.grpo.group_sise'"),
    ({**RL, "grpo": {"top_p": 0.9}}, "'then.grpo.top_p' is not supported"),
    ({**RL, "init_from": "x@latest"}, "then.init_from is set for you"),
    ({**RL, "tenant": "other"}, "then.tenant is set for you"),
    ({**RL, "steps": "many"}, "invalid job in 'then'"),
    ({**RL, "then": {**RL, "then": {"task": "agent"}}}, "invalid job in 'then.then.then'"),
])
def test_a_bad_follow_up_is_refused_with_the_job_naming_its_field(then, message):
    with pytest.raises(SubmitError, match=message):
        parse_submission({**SFT, "then": then})


def test_a_chain_is_bounded():
    chain = dict(RL)
    for _ in range(MAX_THEN_CHAIN):
        chain = {**RL, "then": chain}
    parse_submission({**SFT, "then": dict(chain["then"])})  # MAX_THEN_CHAIN follow-ups: fine
    with pytest.raises(SubmitError, match=f"at most {MAX_THEN_CHAIN} follow-up jobs"):
        parse_submission({**SFT, "then": chain})


def test_the_follow_ups_submission_starts_from_the_last_version_under_a_fixed_key():
    tree = follow_up_tree(RL, "acme", "acme.warm-1a2b")
    assert tree["init_from"] == "acme.warm-1a2b@latest" and tree["tenant"] == "acme"
    assert tree["idempotency_key"] == follow_up_tree(RL, "acme", "acme.warm-1a2b")["idempotency_key"]
    assert tree["idempotency_key"] != follow_up_tree(RL, "acme", "acme.warm-9z9z")["idempotency_key"]
    parse_submission(tree)


def test_the_gateway_checks_a_follow_ups_data_like_the_jobs(tmp_path):
    (tmp_path / "rows.jsonl").write_text("{}\n")
    path = str(tmp_path / "rows.jsonl")
    with pytest.raises(SubmissionRefused, match="field 'dataset'"):  # a server path: refused in the follow-up too
        check_submission({**SFT, "then": {**RL, "dataset": path}}, "acme")
    tree = check_submission({**SFT, "then": {**RL, "dataset": path}}, "acme", allow_paths_under=str(tmp_path))
    assert tree["then"]["dataset"] == path


def test_submit_then_nests_the_second_job_file_with_its_paths(tmp_path):
    (tmp_path / "sft.toml").write_text('name = "warm"\ntask = "sft"\nsteps = 1\ndataset = "demos.jsonl"\n')
    (tmp_path / "rl.toml").write_text('name = "rl"\ntask = "agent"\nsteps = 20\ndataset = "prompts.jsonl"\n'
                                      'reward = "contains"\n')
    args = build_parser().parse_args(["submit", "--then", str(tmp_path / "rl.toml"), str(tmp_path / "sft.toml")])
    job = submission_from_args(args)
    assert job["then"] == read_job_file(tmp_path / "rl.toml")
    assert job["then"]["dataset"] == str(tmp_path / "prompts.jsonl") and job["dataset"] == str(tmp_path / "demos.jsonl")
    assert follow_up(parse_submission(job)).name == "rl"
    with pytest.raises(ValueError, match="--then: job file"):
        submission_from_args(build_parser().parse_args(["submit", "--then", str(tmp_path / "no.toml"),
                                                        str(tmp_path / "sft.toml")]))
