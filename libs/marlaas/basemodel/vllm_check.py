"""Check that vLLM serves the chat base: it loads, generates, takes a LoRA, and agrees with transformers.

Run ``python -m marlaas.basemodel.vllm_check [MODEL_DIR]`` (default: the committed chat
base). It renders a few held-out tool episodes with the model's chat template, generates
greedily with ``vllm.LLM`` (CPU settings as rollout uses them: float32, eager, a small
``max_model_len``, ``generation_config="vllm"``) from the prompts' ids, once without and once
with a PEFT LoRA adapter (rank 8 on the attention projections, ``B`` perturbed so the
adapter changes the output), and compares each to transformers' greedy output (the base
model, and the base with the adapter merged through PEFT). Prints one JSON line and exits
non-zero when anything disagrees. Starts a vLLM engine: about half a minute on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

MAX_TOKENS = 24


def make_adapter(model_dir: Path, out: Path) -> None:
    """A rank-8 LoRA on q/k/v/o with a seeded, non-zero ``B`` (PEFT's init leaves ``B`` at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft.save_pretrained(out)


def transformers_greedy(model_dir: Path, prompts: list[list[int]], adapter: Path | None) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(gen[0, len(ids):].tolist())
    return out


def vllm_greedy(model_dir: Path, prompts: list[list[int]], adapter: Path) -> tuple[list[list[int]], list[list[int]]]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # with OMP_NUM_THREADS: the threads asked for
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(model_dir), enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=512,
              dtype="float32", enforce_eager=True, generation_config="vllm", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    base = [list(r.outputs[0].token_ids) for r in llm.generate(inputs, params, use_tqdm=False)]
    lora = [list(r.outputs[0].token_ids) for r in llm.generate(
        inputs, params, lora_request=LoRARequest("check@v1", 1, str(adapter)), use_tqdm=False)]
    return base, lora


def trim(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", nargs="?", type=Path, default=None)
    parser.add_argument("--episodes", type=int, default=4)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from marlaas.basemodel import builtin_model_dir
    from marlaas.basemodel.chat_eval import prompt_ids
    from marlaas.basemodel.synthetic import heldout_episodes

    model_dir = (args.model_dir or builtin_model_dir()).resolve()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [prompt_ids(tok, e) for e in heldout_episodes(args.episodes, seed=7)]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(tmp) / "adapter"
        make_adapter(model_dir, adapter)
        hf_base = transformers_greedy(model_dir, prompts, None)
        hf_lora = transformers_greedy(model_dir, prompts, adapter)
        vl_base, vl_lora = vllm_greedy(model_dir, prompts, adapter)
    eos = tok.eos_token_id
    same = lambda a, b: [trim(x, eos) == trim(y, eos) for x, y in zip(a, b)]  # noqa: E731
    result = {
        "model_dir": str(model_dir),
        "base_agrees": same(hf_base, vl_base), "lora_agrees": same(hf_lora, vl_lora),
        "lora_changes_output": [trim(x, eos) != trim(y, eos) for x, y in zip(vl_base, vl_lora)],
        "vllm_text": [tok.decode(trim(ids, eos)) for ids in vl_base],
    }
    print(json.dumps(result))
    ok = all(result["base_agrees"]) and all(result["lora_agrees"]) and any(result["lora_changes_output"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
