"""Evaluate the chat base with transformers ``generate``: tool use on held-out tools, and the built-in tasks.

A tool episode is run the way rollout runs one, token in / token out: the prompt is the chat
template's rendering up to the question (``add_generation_prompt=True``); the model's turn
stops at ``</tool_call>`` or ``<|im_end|>``; a call is parsed from the decoded sampled ids;
the observation (the template's tool turn around the result) is tokenized and appended to
the ids as they are; a second turn gives the answer. The tool is simulated: the right tool
with the right argument returns the episode's result; a shown tool with another argument
returns an error; an unknown name returns an error.

Metrics per episode set (shares of episodes): ``wellformed`` a call that parses (any name),
``right_argument`` a call whose arguments are exactly the episode's (any name), ``call`` a
well-formed call to a shown tool,
``right_tool`` the tool the question needs, ``success`` that tool with the right argument
(the call the issue counts: "right tool and argument"), ``answer`` the final answer holds
the tool's result.
"""

from __future__ import annotations

import json

import torch

from marlaas.basemodel.chat_tokenizer import IM_END, token_id
from marlaas.basemodel.synthetic import Episode
from marlaas.tasks import get_task
from marlaas.tools.protocol import CALL_CLOSE, ParsedCall, parse_call

BATCH = 50


def prompt_ids(tok, episode: Episode) -> list[int]:
    """The ids of the conversation up to the first assistant turn, ready for it."""
    first = next(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
    return tok.apply_chat_template(episode.messages[:first], tools=episode.tools, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def observation_ids(tok, result: str) -> list[int]:
    """What follows a call: the template's tool turn around ``result``, up to the next assistant turn."""
    call = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": call}]
    first = tok.apply_chat_template(before, tokenize=False)
    full = tok.apply_chat_template(before + [{"role": "tool", "content": result}], add_generation_prompt=True,
                                   tokenize=False)
    start = first.index(call) + len(call)
    return tok.encode(full[start:], add_special_tokens=False)


@torch.no_grad()
def generate(model, tok, prompts: list[list[int]], max_new_tokens: int, sample: bool) -> list[list[int]]:
    """Each prompt's continuation ids, cut after the first ``<|im_end|>`` or ``</tool_call>`` (kept)."""
    stops = [token_id(tok, IM_END), token_id(tok, CALL_CLOSE)]
    out: list[list[int]] = []
    for at in range(0, len(prompts), BATCH):
        chunk = prompts[at: at + BATCH]
        width = max(len(p) for p in chunk)
        pad = tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
        gen = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad, **kwargs)
        for row in gen[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            out.append(row[:cut])
    return out


def simulate_tool(episode: Episode, call: ParsedCall, shown: set[str]) -> str:
    if call.name not in shown:
        return f"error: unknown tool {call.name!r}"
    if call.name == episode.tool and json.loads(call.arguments) == episode.arguments:
        return episode.result
    return "error: nothing found for those arguments"


def run_tool_episodes(model, tok, episodes: list[Episode], sample: bool, seed: int) -> dict[str, float]:
    """Call, observe, answer on each episode (see the module docstring); shares of episodes."""
    torch.manual_seed(seed)
    prompts = [prompt_ids(tok, e) for e in episodes]
    turns = generate(model, tok, prompts, 48, sample)
    counts = dict.fromkeys(("wellformed", "right_argument", "call", "right_tool", "success", "answer"), 0)
    second, where, texts = [], [], [""] * len(episodes)
    for i, (episode, ids) in enumerate(zip(episodes, turns)):
        text = tok.decode(ids, skip_special_tokens=True)
        call = parse_call(text)
        shown = {t["function"]["name"] for t in episode.tools or []}
        if not isinstance(call, ParsedCall):
            texts[i] = text
            continue
        counts["wellformed"] += 1
        counts["right_argument"] += json.loads(call.arguments) == episode.arguments
        counts["call"] += call.name in shown
        counts["right_tool"] += call.name == episode.tool
        result = simulate_tool(episode, call, shown)
        counts["success"] += result == episode.result
        second.append(prompts[i] + ids + observation_ids(tok, result))
        where.append(i)
    for i, ids in zip(where, generate(model, tok, second, 32, sample)):
        texts[i] = tok.decode(ids, skip_special_tokens=True)
    counts["answer"] = sum(e.result is not None and e.result in t for e, t in zip(episodes, texts))
    return {k: round(v / len(episodes), 4) for k, v in counts.items()}


def task_rewards(model, tok, episodes: list[Episode], sample: bool, seed: int) -> float:
    """Mean reward of a single-turn built-in task's episodes (the task's own reward)."""
    torch.manual_seed(seed)
    task = get_task(episodes[0].task)
    turns = generate(model, tok, [prompt_ids(tok, e) for e in episodes], task.max_new_tokens + 2, sample)
    rewards = [task.reward({"answer": e.answer}, tok.decode(ids, skip_special_tokens=True))
               for e, ids in zip(episodes, turns)]
    return round(sum(rewards) / len(rewards), 4)
