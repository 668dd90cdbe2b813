"""The committed chat base: BPE tokenizer, chat template, synthetic data, and the shipped weights."""

import hashlib
import json
import re
from functools import cache

from transformers import AutoConfig

from marlaas.basemodel import builtin_model_dir
from marlaas.basemodel.chat_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TAG_TOKENS, train_tokenizer
from marlaas.basemodel.synthetic import (
    CALCULATOR,
    Corpus,
    fingerprint,
    heldout_episodes,
    heldout_tools,
    make_tools,
    split_of,
)
from tests.models import tokenizer as tokenizer_of

TOOL = {"type": "function", "function": {
    "name": "lookup_capital", "description": "Look up the capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
}}


@cache
def _tokenizer():
    return tokenizer_of(builtin_model_dir())


def test_special_tokens_and_tags_are_single_ids_and_tags_survive_skip_special():
    tok = _tokenizer()
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS + TAG_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(ids)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    call = '<tool_call>{"name": "f", "arguments": {"x": "y"}}</tool_call>'
    assert tok.decode(tok.encode(call + "<|im_end|>", add_special_tokens=False), skip_special_tokens=True) == call


def test_bytes_round_trip_with_no_unknown_token():
    tok = _tokenizer()
    for text in ("What is the capital of Peru?", "37+45=82\n#### 3.5", "naïve ☃ 東京 \t\n  x", "rev:ab c=", ""):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok.encode("1234", add_special_tokens=False)] == list("1234")  # digits split


def test_vocab_matches_the_model_and_the_weights_are_small():
    tok, config = _tokenizer(), AutoConfig.from_pretrained(builtin_model_dir())
    assert config.model_type == "qwen3" and config.tie_word_embeddings and config.head_dim == 32
    assert config.vocab_size == len(tok) and config.vocab_size % 64 == 0
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    assert (builtin_model_dir() / "model.safetensors").stat().st_size < 50_000_000


def test_chat_template_renders_tools_calls_and_responses_in_the_hermes_shape():
    tok = _tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of Peru?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup_capital", "arguments": {"country": "Peru"}}}]},
        {"role": "tool", "content": "Lima"},
        {"role": "assistant", "content": "Lima"},
    ]
    text = tok.apply_chat_template(messages, tools=[TOOL], tokenize=False)
    schema = json.dumps(TOOL["function"])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\nYou may call one of these tools:\n"
        "<tools>\n" + schema + "\n</tools>\n"
        'To call a tool, write <tool_call>{"name": <tool-name>, "arguments": <args-json-object>}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nCapital of Peru?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "lookup_capital", "arguments": {"country": "Peru"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>Lima</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nLima<|im_end|>\n"
    )
    # a prompt for generation, without a system message or tools; a prefix renders as a prefix
    plain = tok.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nCapital of Peru?<|im_end|>\n<|im_start|>assistant\n"
    for cut in range(1, len(messages)):
        assert text.startswith(tok.apply_chat_template(messages[:cut], tools=[TOOL], tokenize=False))


def test_chat_template_takes_raw_call_text_and_consecutive_tool_results_share_one_turn():
    tok = _tokenizer()
    messages = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": '<tool_call>{"name": "a", "arguments": {}}</tool_call>'},
                {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\n<tool_response>1</tool_response><tool_response>2</tool_response>"
                         "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE


def test_generator_is_deterministic_and_held_out_tools_use_held_out_words_only():
    assert fingerprint(Corpus(3, n_tools=200).episodes(100)) == fingerprint(Corpus(3, n_tools=200).episodes(100))
    assert fingerprint(heldout_episodes(20, seed=5)) == fingerprint(heldout_episodes(20, seed=5))
    train = make_tools(2000, 2, "train")
    held = heldout_tools(12345 + 2)
    assert not {t.name for t in train} & {t.name for t in held}
    assert not {t.keyword for t in train} & {t.keyword for t in held}
    for tool in held:  # a made-up word, a real noun (phrase), or a made-up word + a real noun: all held out
        first, _, rest = tool.keyword.partition(" ")
        assert split_of(tool.keyword) == "heldout" or (split_of(first) == "heldout" and split_of(rest) == "heldout")
    # none of the held-out names or keywords occurs in (a sample of) the training text
    text = fingerprint(Corpus(0, n_tools=4000).episodes(1000))
    found = [t.keyword for t in held if re.search(rf"\b{re.escape(t.keyword)}\b", text)]
    found += [t.name for t in held if f'"{t.name}"' in text]
    assert not found, found


def test_training_labels_are_the_assistant_turns_only():
    from marlaas.basemodel.pretrain import encode_episode

    tok = _tokenizer()
    for episode in Corpus(0, n_tools=50).episodes(30):
        ids, labels = encode_episode(tok, episode)
        assert len(ids) == len(labels)
        trained = tok.decode([t for t in labels if t != -100])
        if episode.task in ("tools", "multiply"):
            call = json.dumps({"name": episode.tool, "arguments": episode.arguments})
            assert trained == f"<tool_call>{call}</tool_call><|im_end|>{episode.answer}<|im_end|>"
        else:
            assert trained == f"{episode.answer}<|im_end|>"
    assert CALCULATOR["function"]["name"] == "calculator"


def test_tokenizer_training_is_deterministic():
    renderer = _tokenizer()
    texts = [renderer.apply_chat_template(e.messages, tools=e.tools, tokenize=False)
             for e in Corpus(9, n_tools=100).episodes(500)]
    first, second = train_tokenizer(texts, vocab_size=512), train_tokenizer(texts, vocab_size=512)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_shipped_weights_match_the_report():
    root = builtin_model_dir()
    report = json.loads((root / "pretrain_report.json").read_text())
    assert (hashlib.sha256((root / "model.safetensors").read_bytes()).hexdigest()
            == report["sha256"]["model.safetensors"])
    held = report["eval"]["heldout_tools"]
    assert {"greedy", "sampled_t1"} <= held.keys() and 0.0 <= held["sampled_t1"]["success"] <= 1.0
