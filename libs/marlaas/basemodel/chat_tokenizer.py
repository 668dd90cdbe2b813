"""The chat base's tokenizer: byte-level BPE in Qwen3's shape, with a chat template of our own.

The tokenizer is trained with ``tokenizers`` on the project's own synthetic corpus
(:mod:`marlaas.basemodel.synthetic`) and saved as a transformers tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``):

- pre-tokenization as Qwen2/Qwen3 (their split regex, single digits, then byte-level with no
  prefix space), so any text encodes (no unknown token) and decodes back to itself;
- special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (end of a turn,
  the eos), and, as in Qwen3, the tags ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
  ``</tool_response>``, ``<think>``, ``</think>`` as *non-special* added tokens: each is one id,
  and they survive ``decode(skip_special_tokens=True)``, so a call can be parsed from text;
- the vocabulary padded with ``<|reserved_N|>`` special tokens to exactly ``VOCAB_SIZE`` (the
  model's embedding size, a multiple of 64, so every id decodes).

The chat template has the Qwen3 / Hermes shape, made compact for a tiny model: the system
turn lists each tool's JSON schema (``{"name", "description", "parameters"}``) one per line
inside ``<tools>``; an assistant's calls render as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; tool results go back as
``<tool_response>...</tool_response>`` inside one user turn. Deviations from Qwen3's own
template: no newlines around a call's or a response's JSON, a one-line instruction instead of
Qwen's paragraph, the ``{"type": "function", "function": ...}`` wrapper dropped (only the
function is shown), and no ``<think>`` handling (the model is never taught to think).
The rendering of a prefix of a conversation is a prefix of the rendering of the whole
(nothing depends on later messages), which training's loss mask relies on.

The tokenizer also ships a ``response_template`` (:data:`RESPONSE_TEMPLATE`, saved in
``tokenizer_config.json``): transformers' declarative response parser, the inverse of the
template's assistant turn, so ``tok.parse_response(text, prefix=prompt)`` turns a model's output
back into ``{"role": "assistant", "content": ..., "tool_calls": [{"type": "function",
"function": {"name": ..., "arguments": {...}}}]}`` (TRL's tool loop reads the same attribute).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
VOCAB_SIZE = 2048
# Qwen2 / Qwen3's pre-tokenizer split: words with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MODEL_MAX_LENGTH = 1024

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif -%}"
    "{%- if tools or ns.system -%}"
    "{{- '<|im_start|>system\\n' + ns.system -}}"
    "{%- if tools -%}"
    "{%- if ns.system %}{{ '\\n\\n' }}{% endif -%}"
    "{{- '# Tools\\nYou may call one of these tools:\\n<tools>' -}}"
    "{%- for tool in tools %}{{ '\\n' + ((tool.function if tool.function is defined else tool) | tojson) }}"
    "{% endfor -%}"
    "{{- '\\n</tools>\\nTo call a tool, write <tool_call>{\"name\": <tool-name>, \"arguments\": <args-json-object>}"
    "</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not loop.first %}{{ '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{% endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user\\n' }}{% endif -%}"
    "{{- '<tool_response>' + message.content + '</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' -}}"
    "{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)

# transformers' response template (``tokenizer.response_template``; ``parse_response`` /
# ``get_response_parser`` read it): the inverse of the template's assistant turn, content then
# each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` then ``<|im_end|>``.
# - content is the text outside the calls, unstripped and joined, so parsing a rendered turn gives
#   its message back exactly and re-rendering a parsed output gives back what the model wrote (a
#   stripped content would not re-render to the sampled tokens); it defaults to "" (calls only);
# - a call's body is JSON (a malformed call raises ValueError, as transformers' own templates do);
# - the turn ends at <|im_end|> (or <|endoftext|>, the other eos), with the "\n" the template
#   writes after it; a turn cut at </tool_call> (rollout's stop string) parses as well.
# Every delimiter is a literal except that end pattern: two literals then one trailing ``\s*``,
# no nested or overlapping quantifiers, so matching is linear in the output (no backtracking).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant", "content": ""},
    "start_anchor": f"{IM_START}assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"(?:<\|im_end\|>|<\|endoftext\|>)\s*", "content": "text",
                    "content_args": {"strip": False}, "repeats": True, "join": ""},
    },
}


def _strip_markup(text: str) -> str:
    """Training text for the BPE merges: special tokens and tags are single ids, never merged."""
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        text = text.replace(token, "\n")
    return text


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts`` (rendered conversations), with the chat template set."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS), min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator((_strip_markup(t) for t in texts), trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    short = vocab_size - core.get_vocab_size(with_added_tokens=True)
    core.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(short)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    check_tokenizer(tok, vocab_size)
    return tok


def check_tokenizer(tok: PreTrainedTokenizerFast, vocab_size: int = VOCAB_SIZE) -> None:
    """The invariants the model and rollout rely on; raises AssertionError when one fails."""
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, (token, ids)
    for text in ("What is the zorblat level of Qevari?", "37+45=82", "rev:ab c=", "naïve ☃ 東京 \t\n  x",
                 '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, (text, tok.decode(ids))
    call = {"role": "assistant", "content": "ok", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": [1, "y"]}}}]}
    parsed = tok.parse_response(tok.encode('ok<tool_call>{"name": "f", "arguments": {"x": [1, "y"]}}</tool_call>'
                                           f"{IM_END}", add_special_tokens=False), prefix="")
    assert parsed == call, parsed


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` in ``out``."""
    tok.save_pretrained(out)


def token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one of the special tokens or tags."""
    (found,) = tok.encode(token, add_special_tokens=False)
    return found
