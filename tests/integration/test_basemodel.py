"""The committed built-in base model: it loads, its tokenizer is exact, it knows the tasks but samples loosely."""

from functools import cache

import torch
from transformers import AutoModelForCausalLM

from marlaas.basemodel import char_model_dir
from marlaas.tasks import get_task
from tests.models import tokenizer as tokenizer_of

TOY_TASKS = ("addition", "reverse", "repeat")


@cache
def _tokenizer():
    return tokenizer_of(char_model_dir())


@cache
def _model():
    return AutoModelForCausalLM.from_pretrained(char_model_dir(), dtype=torch.float32).eval()


def _reward(name: str, sample: bool, n: int = 40) -> float:
    """Mean reward on n fixed problems, greedy or sampled at temperature 1.0 (fixed seed)."""
    task, tok, model = get_task(name), _tokenizer(), _model()
    problems = task.problems(n, seed=2024)
    tok.padding_side = "left"
    enc = tok([p["prompt"] for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(7)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=task.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **kwargs,
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / n


def test_model_dir_holds_a_small_float32_qwen3():
    root = char_model_dir()
    assert (root / "model.safetensors").stat().st_size < 8_000_000
    model, tok = _model(), _tokenizer()
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.head_dim == 32 and cfg.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.vocab_size == len(tok) and cfg.vocab_size % 64 == 0
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<eos>")
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<pad>")
    assert tok.bos_token_id is None


def test_tokenizer_is_one_token_per_character_and_round_trips():
    tok = _tokenizer()
    for text in ("37+45=82", "rev:ab c=", "dup:xyz=xyzxyz", "Tom has $3.50 (2*1.75)?\n#### 3.5!'\""):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == [tok.convert_tokens_to_ids(ch) for ch in text]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok("ab", add_special_tokens=True)["input_ids"] == tok("ab", add_special_tokens=False)["input_ids"]


def test_model_knows_every_toy_task_but_samples_loosely():
    # Pretrained with label smoothing: greedy decoding is (nearly) right, temperature-1.0
    # samples earn partial credit only, so RL has signal and room (sharpening). An
    # untrained model fails the greedy bound, a plainly over-trained one the sampled bound.
    for name in TOY_TASKS:
        greedy, sampled = _reward(name, sample=False), _reward(name, sample=True)
        assert greedy > 0.75, f"{name}: greedy reward {greedy:.3f}: the model does not know the task"
        assert 0.2 < sampled < 0.7, f"{name}: temperature-1.0 reward {sampled:.3f} is not partial"
        assert greedy - sampled > 0.25, f"{name}: greedy {greedy:.3f} vs sampled {sampled:.3f}: no gap for RL"


def test_missing_model_dir_says_how_to_build_it(tmp_path, monkeypatch):
    import marlaas.basemodel as basemodel

    monkeypatch.setattr(basemodel, "_TINY", tmp_path / "tiny")
    try:
        basemodel.char_model_dir()
    except FileNotFoundError as err:
        assert "marlaas.basemodel.pretrain_char" in str(err)
    else:
        raise AssertionError("char_model_dir() did not notice the missing model")


def test_model_half_knows_the_tool_call_format():
    """On the agentic task the base writes a well-formed calculator call on a minority of samples
    (RL's room: call it always) and guesses the rest; one tool round is run as pretraining did."""
    from marlaas.basemodel.pretrain_char import evaluate

    model = _model()
    problems = get_task("multiply").problems(60, seed=2024)
    reward, calls = evaluate(model, _tokenizer(), "multiply", problems, sample=True, seed=7)
    model.eval()
    assert 0.15 <= calls <= 0.6, f"share of samples with a well-formed call: {calls:.2f}"
    assert 0.15 < reward < 0.65, f"temperature-1.0 reward {reward:.3f}"
