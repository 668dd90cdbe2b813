"""Config: defaults <- TOML file <- MARLAAS_* env <- overrides, with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlaas.platform.config import Config, ConfigError, dump_config, load_config, read_config_json


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "marlaas.toml"
    path.write_text(text)
    return path


def test_defaults():
    config = load_config(env={})
    assert (config.nats_url, config.store_url, config.base_model) == ("", "", "")
    assert config.manager.schedule == "async"
    assert config.trainer.device == "cpu"
    assert config.rollout.max_loras == 16
    assert config.home_dir == Path("~/.marlaas").expanduser().resolve()
    assert config.resolved_store_url == f"file://{config.home_dir / 'store'}"


def test_file_then_env_then_overrides(tmp_path):
    path = write_toml(tmp_path, """
        nats_url = "nats://from-file:4222"
        log_level = "debug"
        [manager]
        schedule = "async"
        [rollout]
        max_loras = 4
        kv_cache_gib = 2
    """)
    env = {"MARLAAS_NATS_URL": "nats://from-env:4222", "MARLAAS_SCHEDULE": "sequential",
           "MARLAAS_DEVICE": "cuda", "MARLAAS_STORE_URL": ""}
    overrides = {"nats_url": "nats://from-flag:4222", "log_format": None, "rollout.max_loras": 2}

    config = load_config(path, overrides=overrides, env=env)

    assert config.nats_url == "nats://from-flag:4222"  # flag beats env beats file
    assert config.manager.schedule == "sequential"  # env beats file
    assert config.trainer.device == "cuda"  # env over the default
    assert config.rollout.max_loras == 2  # flag beats file
    assert config.rollout.kv_cache_gib == 2  # file over the default
    assert config.log_level == "debug"
    assert config.log_format == "console"  # a None flag means "not given"
    assert config.store_url == ""  # an empty env var means "not set"


def test_config_path_from_env(tmp_path):
    path = write_toml(tmp_path, 'home = "/srv/marlaas"\n')
    config = load_config(env={"MARLAAS_CONFIG": str(path)})
    assert config.home_dir == Path("/srv/marlaas")
    assert config.resolved_store_url == "file:///srv/marlaas/store"


@pytest.mark.parametrize(("toml", "key"), [
    ("nats_ulr = 'nats://x:4222'\n", "nats_ulr"),
    ("[rollout]\nkv_cach_gib = 2\n", "kv_cach_gib"),
    ("[trainers]\ndevice = 'cpu'\n", "trainers"),
])
def test_misspelled_key_in_file_is_named(tmp_path, toml, key):
    with pytest.raises(ConfigError, match=f"unknown field `{key}`"):
        load_config(write_toml(tmp_path, toml), env={})


def test_misspelled_override_is_named():
    with pytest.raises(ConfigError, match=r"unknown field `shedule`.*\$\.manager"):
        load_config(overrides={"manager.shedule": "sync"}, env={})


@pytest.mark.parametrize(("toml", "field"), [
    ("[rollout]\nmax_loras = 'many'\n", r"Expected `int`, got `str` - at `\$\.rollout\.max_loras`"),
    ("log_format = 'xml'\n", r"\$\.log_format"),
    ("[manager]\nkv_budget_gib = [1, 2]\n", r"\$\.manager\.kv_budget_gib"),
    ("rollout = 3\n", r"\$\.rollout"),
])
def test_wrong_type_names_the_field(tmp_path, toml, field):
    with pytest.raises(ConfigError, match=field):
        load_config(write_toml(tmp_path, toml), env={})


def test_bad_env_value_names_the_field():
    with pytest.raises(ConfigError, match=r"\$\.trainer\.device"):
        load_config(env={"MARLAAS_DEVICE": "tpu"})


def test_missing_or_invalid_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write_toml(tmp_path, "nats_url = \n"), env={})


def test_base_model_must_be_a_model_directory(tmp_path):
    missing = Config(base_model=str(tmp_path / "no-such-model"))
    clear = r"base_model: .*no-such-model is not a .*model directory \(no config\.json\)"
    with pytest.raises(ConfigError, match=clear):
        _ = missing.base_model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="save_pretrained"):
        _ = Config(base_model=str(tmp_path / "empty")).base_model_dir


def test_base_model_directory_resolves(tmp_path):
    model = tmp_path / "qwen3-0.6b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert Config(base_model=str(model)).base_model_dir == model.resolve()


def test_config_json_round_trip_for_child_processes():
    config = load_config(overrides={"manager.schedule": "sequential", "rollout.max_loras": 3}, env={})
    assert read_config_json(dump_config(config)) == config


def test_values_out_of_range_are_refused():
    with pytest.raises(ConfigError, match="hot_adapters"):
        load_config(overrides={"trainer.hot_adapters": 0}, env={})
    with pytest.raises(ConfigError, match="schedule"):
        load_config(overrides={"manager.schedule": "round-robin"}, env={})


README = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# documented with a value that is not a literal default (a host:port, a variable, a rule)
NOT_LITERAL = {"gateway.port", "gateway.allow_server_paths_under", "gateway.operator_token"}


def documented_defaults() -> dict[str, str]:
    """Every "`section.field` (value...)" in docs/configuration.md: field -> the
    value as written, up to its first comma, semicolon or space-separated remark."""
    import re

    text = README.read_text()
    section = text[:text.index("## Every setting")]  # the generated table is not what a person wrote
    found = {}
    for field, value in re.findall(r"`([a-z_]+\.[a-z_.]+)` \(([^)]*)\)", section):
        found[field] = re.split(r"[,;]| = | \(", value)[0].strip()
    return found


def parse_documented(value: str):
    value = value.strip("`").strip('"')
    if value in ("true", "false"):
        return str(value == "true")  # as the TOML is written, as Python shows it
    units = {"MiB": 2**20, "GiB": 2**30}
    number, _, unit = value.partition(" ")
    try:
        parsed = float(number)
    except ValueError:
        return value
    return parsed * units[unit] if unit in units else parsed


def test_every_documented_default_is_the_default():
    """docs/configuration.md, default by default: a changed default or a stale line
    fails here (the section documents at least 20 with literal values)."""
    config = Config()
    checked = 0
    for field, written in documented_defaults().items():
        if field in NOT_LITERAL:
            continue
        section, name = field.split(".", 1)
        actual = getattr(getattr(config, section), name)
        documented = parse_documented(written)
        if isinstance(documented, float):
            assert float(actual) == documented, (f"docs/configuration.md says {field} defaults to {written}, "
                                                 f"it is {actual}")
        else:
            assert str(actual) == documented, (f"docs/configuration.md says {field} defaults to {written}, "
                                               f"it is {actual!r}")
        checked += 1
    assert checked >= 20, documented_defaults()


def test_the_default_base_is_the_chat_model_and_the_character_level_one_is_named():
    from marlaas.basemodel import builtin_model_dir, char_model_dir

    assert Config().base_model_dir == builtin_model_dir()
    assert (Config().base_model_dir / "chat_template.jinja").is_file()
    assert Config(base_model="builtin:chat").base_model_dir == builtin_model_dir()
    with pytest.raises(ConfigError, match=r"'builtin:tiny' is not a built-in model; use one of builtin:chat, "
                                          r"builtin:char"):
        _ = Config(base_model="builtin:tiny").base_model_dir
    with pytest.raises(ConfigError, match=r"'builtin:char' has no chat template: set rollout.prompt_format = \"bare\""):
        load_config(overrides={"base_model": "builtin:char"}, env={})
    bare = load_config(overrides={"base_model": "builtin:char", "rollout.prompt_format": "bare"}, env={})
    assert bare.base_model_dir == char_model_dir()


def test_the_default_context_is_lowered_to_a_base_models_own_and_an_explicit_one_is_kept():
    from marlaas.platform.config import load_config

    char = {"base_model": "builtin:char", "rollout.prompt_format": "bare"}
    assert load_config(env={}).rollout.max_model_len == 1024  # the chat base's own context
    assert load_config(overrides=char, env={}).rollout.max_model_len == 512  # its config.json says 512
    assert load_config(overrides={**char, "rollout.max_model_len": 300}, env={}).rollout.max_model_len == 300
