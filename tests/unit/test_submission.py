"""Job submissions from TOML files and CLI flags: unknown keys and bad types fail loudly."""


import pytest

from marlaas.cli.commands import build_parser
from marlaas.cli.job_commands import submission_from_args
from marlaas.platform.api import SubmitError, parse_submission


def test_submission_defaults_and_overrides():
    job = parse_submission({"name": "a", "task": "addition", "steps": 3, "grpo": {"group_size": 4}})
    assert job.grpo.group_size == 4 and job.grpo.prompts_per_step == 8 and job.lora.rank == 8


@pytest.mark.parametrize("tree, message", [
    ({"name": "a", "task": "addition", "steps": 3, "stpes": 4}, "unknown field 'stpes'"),
    ({"name": "a", "task": "addition", "steps": 3, "lora": {"rnk": 4}}, "unknown field 'lora.rnk'"),
    ({"name": "a", "task": "addition", "steps": "many"}, "steps"),
    ({"name": "a", "steps": 3}, "task"),
])
def test_bad_submissions_name_the_field(tree, message):
    with pytest.raises(SubmitError, match=message):
        parse_submission(tree)


def test_cli_merges_job_file_flags_and_set(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('name = "mine"\ntask = "reverse"\nsteps = 5\n[grpo]\ngroup_size = 4\n')
    args = build_parser().parse_args(
        ["submit", str(path), "--steps", "7", "--set", "grpo.learning_rate=0.01", "--set", "lora.rank=4"])
    job = submission_from_args(args)
    assert job == {"name": "mine", "task": "reverse", "steps": 7,
                   "grpo": {"group_size": 4, "learning_rate": 0.01}, "lora": {"rank": 4}}
    parse_submission(job)


def test_cli_submission_errors(tmp_path):
    parser = build_parser()
    with pytest.raises(ValueError, match="missing task and steps"):
        submission_from_args(parser.parse_args(["submit"]))
    with pytest.raises(ValueError, match="does not exist"):
        submission_from_args(parser.parse_args(["submit", str(tmp_path / "nope.toml")]))
    with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
        submission_from_args(parser.parse_args(["submit", "--task", "addition", "--steps", "1", "--set", "x"]))


def test_the_documented_job_file_is_a_valid_submission():
    import re
    import tomllib
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "using.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", readme, re.S)
    job = parse_submission(tomllib.loads(block))
    assert job.task == "reverse" and job.grpo.scale_by_std and job.lora.rank == 8


def test_a_jobs_priority_is_low_normal_or_high_and_reaches_its_spec_and_view():
    from marlaas.platform import api

    assert api.parse_submission({"task": "addition", "steps": 2}).priority == "normal"
    request = api.parse_submission({"task": "addition", "steps": 2, "priority": "high"})
    assert request.priority == "high"
    from marlaas.platform.events import JobRecord
    from services.manager.validation import build_spec

    spec = build_spec(request, request.grpo, (), 0.0)
    assert spec.priority == "high" and api.job_view(JobRecord(spec=spec)).priority == "high"
    for wrong, where in (({"priority": "urgent"}, "'priority'"), ({"then": {"task": "addition", "steps": 1,
                                                                          "priority": 3}}, "'then.priority'")):
        with pytest.raises(api.SubmitError, match=f"{where} is .*choose one of low, normal, high"):
            api.parse_submission({"task": "addition", "steps": 2, **wrong})
