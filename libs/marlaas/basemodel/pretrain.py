"""Pretrain the chat base: a BPE-tokenized Qwen3 that reads tool schemas and calls tools it never saw.

Run ``python -m marlaas.basemodel.pretrain [--out DIR] [--steps N]``. Straight-line and
reproducible to the byte on one machine: fixed seeds, deterministic torch ops, one thread
(tokenizers' trainer too). The default run (4,000 steps) took 1,503 s of CPU (2,090 s wall
beside a test run on this 2-core machine) plus about a minute of evaluation
(``chat/pretrain_report.json``); ``--eval-only`` re-runs the evaluation alone.

1. renders ``TOKENIZER_EPISODES`` synthetic conversations (:mod:`marlaas.basemodel.synthetic`)
   with the chat template and trains the byte-level BPE tokenizer on them
   (:mod:`marlaas.basemodel.chat_tokenizer`);
2. builds a small Qwen3 (``MODEL``: tied embeddings, head_dim 32, float32);
3. trains it with next-token cross-entropy on the whole conversation, the assistant turns
   (the call, the final answer and each turn's ``<|im_end|>``) at full weight and the rest
   (system turn with the tool schemas, question, tool response) at ``CONTEXT_WEIGHT``:
   modelling the context (a keyword seen in a description comes back in the question, a name
   in the call) is what teaches a small model to copy, and costs nothing extra. A fresh stream
   of episodes per step (the mix in ``synthetic.MIX``), AdamW with warmup and cosine decay;
4. saves the model directory (``config.json``, ``model.safetensors``,
   ``generation_config.json``, the tokenizer files) and evaluates with transformers'
   ``generate`` (:mod:`marlaas.basemodel.chat_eval`): held-out made-up tools greedy and
   sampled at temperature 1.0, tools seen in training, and the built-in tasks; writes it all
   to ``pretrain_report.json`` with the training time and the weights' sha256.

Unlike the character-level base (:mod:`marlaas.basemodel.pretrain_char`) no label smoothing is
used: the model is small and briefly trained, so it is unsure of unseen tools on its own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path

SEED = 0
EVAL_SEED = 12345
THREADS = 1
TOKENIZER_EPISODES = 20_000
MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}
MAX_POSITIONS = 1024
BATCH = 8
LR = 3e-3
WARMUP = 100
FINAL_LR_FRACTION = 0.05
EVAL_EPISODES = 200
CONTEXT_WEIGHT = 0.5
DEFAULT_OUT = Path(__file__).resolve().parent / "chat"


def encode_episode(tok, episode) -> tuple[list[int], list[int]]:
    """Ids of the whole conversation and labels: the assistant turns' ids (through ``<|im_end|>``), -100 elsewhere."""
    messages, tools = episode.messages, episode.tools
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False))
            end = len(tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)) - 1  # not the "\n"
            assert text[end - len("<|im_end|>"): end] == "<|im_end|>", text[start:end + 1]
            spans.append((start, end))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"]):
        inside = any(start <= lo and hi <= end for start, end in spans)
        labels.append(token if inside else -100)
    return enc["input_ids"], labels


def make_batch(rows: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(labs)
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def build_model(tok):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        dtype="float32", architectures=["Qwen3ForCausalLM"], **MODEL,
    )
    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(config).float()


def train(model, tok, corpus, steps: int, log_every: int) -> list[tuple[int, float]]:
    """``steps`` AdamW steps of BATCH fresh episodes each; the loss every ``log_every`` steps."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(s: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
        return min(1.0, (s + 1) / WARMUP) * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses, started = [], time.perf_counter()
    for step in range(1, steps + 1):
        rows = sorted((encode_episode(tok, e) for e in corpus.episodes(BATCH)), key=lambda r: len(r[0]))
        total, weight = torch.zeros((), device=model.device), 0.0
        for part in (rows[: BATCH // 2], rows[BATCH // 2:]):  # short and long halves: less padding
            input_ids, labels, mask = (t.to(model.device) for t in make_batch(part, tok.pad_token_id))
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
            per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1),
                                        reduction="none").view_as(input_ids[:, 1:])
            # the assistant's turns at full weight, the rest of the conversation (schemas, question,
            # tool result) at CONTEXT_WEIGHT: language modelling the context teaches the copying
            w = torch.where(labels[:, 1:] != -100, 1.0, CONTEXT_WEIGHT) * mask[:, 1:]
            total = total + (per_token * w).sum()
            weight += float(w.sum())
        loss = total / weight
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            losses.append((step, round(loss.item(), 4)))
            print(f"step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - started:.0f}s)", flush=True)
    model.eval()
    return losses


def evaluate(model, tok, eval_episodes: int) -> dict:
    """The report's figures (see :mod:`marlaas.basemodel.chat_eval`)."""
    from marlaas.basemodel.chat_eval import run_tool_episodes, task_rewards
    from marlaas.basemodel.synthetic import Corpus, heldout_episodes, task_episode

    heldout = heldout_episodes(eval_episodes, EVAL_SEED)
    seen = [e for e in Corpus(EVAL_SEED).episodes(4 * eval_episodes) if e.task == "tools"][:eval_episodes]
    rng = random.Random(EVAL_SEED)
    report = {
        "heldout_tools": {"greedy": run_tool_episodes(model, tok, heldout, False, EVAL_SEED),
                          "sampled_t1": run_tool_episodes(model, tok, heldout, True, EVAL_SEED)},
        "seen_tools": {"greedy": run_tool_episodes(model, tok, seen, False, EVAL_SEED),
                       "sampled_t1": run_tool_episodes(model, tok, seen, True, EVAL_SEED)},
        "tasks": {},
    }
    multiply = [task_episode(rng, "multiply") for _ in range(eval_episodes // 2)]
    report["tasks"]["multiply"] = {"greedy": run_tool_episodes(model, tok, multiply, False, EVAL_SEED),
                                   "sampled_t1": run_tool_episodes(model, tok, multiply, True, EVAL_SEED)}
    for name in ("addition", "reverse", "repeat"):
        episodes = [task_episode(rng, name) for _ in range(eval_episodes // 2)]
        report["tasks"][name] = {"greedy": task_rewards(model, tok, episodes, False, EVAL_SEED),
                                 "sampled_t1": task_rewards(model, tok, episodes, True, EVAL_SEED)}
    return report


def save(model, tok, out: Path) -> str:
    """The model directory; returns the sha256 of ``model.safetensors``."""
    from transformers import GenerationConfig

    from marlaas.basemodel.chat_tokenizer import ENDOFTEXT, save_tokenizer, token_id

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)
    save_tokenizer(tok, out)
    GenerationConfig(eos_token_id=[tok.eos_token_id, token_id(tok, ENDOFTEXT)],
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def reevaluate(out: Path, eval_episodes: int) -> None:
    """The report's ``eval`` section again, from the saved model (same seeds: same figures)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    report = json.loads((out / "pretrain_report.json").read_text())
    eval0 = time.perf_counter()
    figures = evaluate(model, tok, eval_episodes)
    report["eval"] = {"episodes": eval_episodes, "seed": EVAL_SEED, **figures,
                      "wall_s": round(time.perf_counter() - eval0, 1)}
    (out / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["eval"], indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=4000, help="optimizer steps (default 4000)")
    parser.add_argument("--eval-episodes", type=int, default=EVAL_EPISODES, help="episodes per evaluation set")
    parser.add_argument("--train-tools", type=int, default=None,
                        help="made-up training tools (default synthetic.TRAIN_TOOLS)")
    parser.add_argument("--eval-only", action="store_true",
                        help="re-evaluate the model in --out and rewrite its report's eval section (no training)")
    args = parser.parse_args(argv)
    if args.eval_only:
        return reevaluate(args.out, args.eval_episodes)

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' trainer: one thread, one order
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from marlaas.basemodel.chat_tokenizer import train_tokenizer
    from marlaas.basemodel.synthetic import MIX, TRAIN_TOOLS, Corpus

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    wall0, cpu0 = time.perf_counter(), time.process_time()

    sample = Corpus(SEED + 100).episodes(TOKENIZER_EPISODES)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast  # a template-only tokenizer renders the corpus

    from marlaas.basemodel.chat_tokenizer import CHAT_TEMPLATE

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    renderer.chat_template = CHAT_TEMPLATE
    tok = train_tokenizer(renderer.apply_chat_template(e.messages, tools=e.tools, tokenize=False) for e in sample)
    model = build_model(tok)
    params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: vocab {len(tok)}; model: {params:,} parameters", flush=True)

    corpus = Corpus(SEED, args.train_tools or TRAIN_TOOLS)
    losses = train(model, tok, corpus, args.steps, log_every=max(1, args.steps // 30))
    train_wall, train_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    sha = save(model, tok, args.out)

    eval0 = time.perf_counter()
    figures = evaluate(model, tok, args.eval_episodes)
    report = {
        "model": {"parameters": params, "vocab_size": len(tok), **MODEL, "max_position_embeddings": MAX_POSITIONS},
        "data": {"mix": MIX,
                 "train_tools": len(corpus.tools), "heldout_tools": "synthetic.heldout_tools(EVAL_SEED + 2)",
                 "tokenizer_episodes": TOKENIZER_EPISODES},
        "train": {"steps": args.steps, "batch": BATCH, "episodes": args.steps * BATCH, "lr": LR, "seed": SEED,
                  "threads": THREADS, "wall_s": round(train_wall, 1), "cpu_s": round(train_cpu, 1),
                  "loss": losses},
        "eval": {"episodes": args.eval_episodes, "seed": EVAL_SEED, **figures,
                 "wall_s": round(time.perf_counter() - eval0, 1)},
        "sha256": {"model.safetensors": sha},
    }
    (args.out / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["eval"], indent=2))
    print(f"trained in {train_wall:.0f}s wall ({train_cpu:.0f}s CPU); saved to {args.out}; sha256 {sha}")


if __name__ == "__main__":
    main()
