import json

import pytest

from marlaas.platform import api
from services.manager.warm_start import InitSource, parse_init_from, servable_problem


def test_init_from_names_a_job_of_the_tenant_at_a_version_or_its_latest():
    assert parse_init_from("acme.warm-1a2b3c@latest", "acme") == InitSource("acme.warm-1a2b3c", None)
    assert parse_init_from("warm-1a2b3c@12", "acme") == InitSource("acme.warm-1a2b3c", 12)


@pytest.mark.parametrize("value, says", [
    ("warm", "write JOB@VERSION"), ("@3", "write JOB@VERSION"), ("warm@last", "a number or 'latest'"),
    ("warm@-1", "a number or 'latest'"), ("warm@99999999999", "a number or 'latest'"),
])
def test_a_malformed_init_from_says_what_to_write(value, says):
    with pytest.raises(api.SubmitError, match=says):
        parse_init_from(value, "acme")


@pytest.mark.parametrize("value", ["acme.>@latest", "acme.*@3", ">@latest", "*@1", "acme.a.b@latest",
                                   "acme.Warm@2", "acme.warm\n@1", "acme.@latest", "bob.>@latest"])
def test_a_job_in_init_from_must_be_a_job_id_never_a_subject_wildcard(value):
    """A wildcard would have read every job of the tenant's (the versions bucket, the POLICY stream) at once."""
    with pytest.raises(api.SubmitError, match="is not a job id"):
        parse_init_from(value, "acme")


def test_a_tinker_checkpoint_is_named_by_its_path():
    path = "tinker://acme.m1/sampler_weights/after-3"
    assert parse_init_from(path, "acme") == InitSource(checkpoint=path)
    for bad in ("tinker://acme.m1", "tinker://" + "x/" * 300):
        with pytest.raises(api.SubmitError, match="a Tinker checkpoint is tinker://"):
            parse_init_from(bad, "acme")


def test_only_an_adapter_the_engine_serves_can_start_a_job():
    def config(rank, modules):
        return json.dumps({"r": rank, "lora_alpha": 16, "target_modules": modules}).encode()

    targets = frozenset({"q_proj", "v_proj", "o_proj"})
    assert servable_problem(config(8, ["q_proj", "v_proj"]), 16, targets) == ""
    assert "rank is 32, and this stack serves ranks up to 16" in servable_problem(config(32, ["q_proj"]), 16, targets)
    foreign = servable_problem(config(8, ["q_proj", "mlp.c_fc"]), 16, targets)
    assert "['mlp.c_fc'], which are not linear layers" in foreign
