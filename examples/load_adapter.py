"""Use a pulled adapter outside marlaas: greedy outputs through peft and through vLLM.

    marlaas pull JOB --out adapter/
    python examples/load_adapter.py adapter/ [BASE_MODEL_DIR] [--prompt 12+30= ...]

Prints one JSON line per prompt and engine; the two engines agree on the greedy text.
"""

import argparse
import json
import os


def with_peft(base_dir: str, adapter_dir: str, prompts: list[str], max_tokens: int) -> list[str]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        outputs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return outputs


def with_vllm(base_dir: str, adapter_dir: str, prompts: list[str], max_tokens: int) -> list[str]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=base_dir, enable_lora=True, max_lora_rank=16, max_model_len=512, dtype="float32",
              enforce_eager=True, generation_config="vllm")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = llm.generate(prompts, params, lora_request=LoRARequest("pulled", 1, adapter_dir))
    return [r.outputs[0].text for r in results]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("adapter_dir")
    parser.add_argument("base_dir", nargs="?", help="the base model (default: marlaas' built-in tiny model)")
    parser.add_argument("--prompt", action="append", default=None)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    if args.base_dir is None:
        from marlaas.basemodel import builtin_model_dir

        args.base_dir = str(builtin_model_dir())
    prompts = args.prompt or ["12+30=", "rev:abcd=", "dup:xyz="]
    for name, run in (("peft", with_peft), ("vllm", with_vllm)):
        for prompt, text in zip(prompts, run(args.base_dir, args.adapter_dir, prompts, args.max_tokens)):
            print(json.dumps({"engine": name, "prompt": prompt, "text": text}), flush=True)
