"""How long a submission's prompts are: cheap character bounds first, then a capped token count.

The manager sizes a job by its longest prompt (``system`` + the task's longest prompt): it must
leave room for ``grpo.max_new_tokens`` in ``rollout.max_model_len``, and it sets the job's
KV-cache footprint. Tokenizing is the costly step, and a tenant chooses its input: a ~900 KB
``system`` over 150 uploaded rows once held the manager's event loop for over a minute
(issue 35, F1). So, as pure functions of the text and two facts of the stack:

1. **Character bounds, before any tokenizer runs.** No token of the base model's tokenizer
   spells more than ``max_token_chars`` characters (its longest vocabulary entry), so a text
   longer than ``max_model_len * max_token_chars`` characters cannot fit in ``max_model_len``
   tokens, whatever it says: ``system`` and each prompt are refused by that bound, by name.
2. **A capped count, off the event loop** (the manager runs it in a thread). Prompts are taken
   longest first by UTF-8 bytes; a prompt has at most ``bytes + 1`` tokens (no token is shorter
   than a byte; +1 for a tokenizer's leading-space token), so once the next prompt's bound is no
   more than the longest count so far, none of the rest can be longer and counting stops. It
   stops too at the first prompt that does not fit (the error names it), and after
   ``TOKENIZE_BUDGET_CHARS`` characters: the prompts left are sized by their byte bound (an
   over-estimate of the footprint, never an under-estimate), capped at what would fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from marlaas.platform.api import SubmitError

# characters of prompts counted per submission: ~0.3 s of one core (measured), so one tenant's
# submission holds the manager's one tokenizer (a lock: validations run in threads) only that long
TOKENIZE_BUDGET_CHARS = 2_000_000
BATCH = 256  # prompts per tokenizer call (a fast tokenizer counts a batch in parallel)


def max_token_chars(vocabulary: Sequence[str]) -> int:
    """The longest vocabulary entry's length: no token spells more characters (a byte-level BPE
    entry has one character per byte, and a text's characters are no more than its bytes)."""
    return max((len(entry) for entry in vocabulary), default=1) or 1


def text_bound(max_model_len: int, token_chars: int) -> int:
    """Characters beyond which a text cannot fit in ``max_model_len`` tokens."""
    return max_model_len * token_chars


def system_refusal(system: str, max_model_len: int, token_chars: int) -> str:
    """Why ``system`` is too long to ever fit ("" = it may fit), without tokenizing it."""
    bound = text_bound(max_model_len, token_chars)
    if len(system) <= bound:
        return ""
    return (f"system is {len(system)} characters: no more than {bound} can fit in rollout.max_model_len "
            f"({max_model_len} tokens, at most {token_chars} characters each); shorten the system prompt")


def prompts_refusal(prompts: Sequence[str], max_model_len: int, token_chars: int) -> str:
    """Why one of the task's prompts is too long to ever fit ("" = each may fit), naming the first
    such (its row of the dataset, counting non-blank lines), without tokenizing any."""
    bound = text_bound(max_model_len, token_chars)
    for row, prompt in enumerate(prompts, start=1):
        if len(prompt) > bound:
            return (f"the prompt of dataset row {row} (counting non-blank lines; a conversation's messages "
                    f"together) is {len(prompt)} characters: no more than {bound} can fit in rollout.max_model_len "
                    f"({max_model_len} tokens, at most {token_chars} characters each); shorten or drop that row")
    return ""


def longest_prompt_tokens(count: Callable[[list[str]], list[int]], system: str, prompts: Sequence[str],
                          max_model_len: int, max_new_tokens: int, budget_chars: int = TOKENIZE_BUDGET_CHARS) -> int:
    """Tokens of ``system`` plus the task's longest prompt, counted with ``count`` (texts -> token
    counts) as the module docstring says; :class:`SubmitError` naming the first prompt found not to
    leave ``max_new_tokens`` of ``max_model_len``."""
    limit = max_model_len - max_new_tokens

    def too_long(what: str, tokens: int) -> SubmitError:
        return SubmitError(f"{what} ({tokens} tokens) + grpo.max_new_tokens ({max_new_tokens}) exceeds "
                           f"rollout.max_model_len ({max_model_len}); shorten it or lower max_new_tokens")

    system_tokens = count([system])[0] if system else 0
    if system_tokens > limit:
        raise too_long("system", system_tokens)
    sizes = [len(prompt.encode("utf-8", "surrogatepass")) + 1 for prompt in prompts]
    order = sorted(range(len(prompts)), key=sizes.__getitem__, reverse=True)
    longest, spent = 0, 0
    for start in range(0, len(order), BATCH):
        if sizes[order[start]] <= longest:
            break  # no prompt left can have more tokens than one counted
        if spent >= budget_chars:  # the rest by their byte bound: an over-estimate, capped at the limit
            return system_tokens + max(longest, min(sizes[order[start]], limit - system_tokens))
        rows = order[start:start + BATCH]
        for row, tokens in zip(rows, count([prompts[i] for i in rows])):
            if system_tokens + tokens > limit:
                with_system = " with the system prompt" if system_tokens else ""
                raise too_long(f"the prompt of dataset row {row + 1} (counting non-blank lines){with_system}",
                               system_tokens + tokens)
            longest = max(longest, tokens)
        spent += sum(len(prompts[i]) for i in rows)
    return system_tokens + longest
