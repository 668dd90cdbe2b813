import json

import pytest

from marlaas.platform import api
from services.manager.warm_start import InitSource, lora_of, parse_init_from


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


def test_the_lora_shape_is_read_from_the_adapter_config():
    config = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"]}).encode()
    shape = lora_of(config)
    assert (shape.rank, shape.alpha, shape.target_modules) == (4, 8, ("q_proj", "v_proj"))
