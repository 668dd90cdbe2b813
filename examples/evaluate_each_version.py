"""Follow a job: on every committed version, pull its adapter and evaluate it greedily with peft.

    python examples/evaluate_each_version.py JOB [--problems 20]

Run it beside `marlaas up` (it finds the embedded stack's broker and store), or set
MARLAAS_NATS_URL / MARLAAS_STORE_URL for a deployed one. It prints one line per version.
"""

import argparse
import asyncio
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from marlaas.platform.config import load_config
from marlaas.platform.events import PolicyCommitted
from marlaas.platform.nats_client import AdapterGone, BusClient
from marlaas.sdk.discovery import running_nats_url
from marlaas.tasks import get_task


def evaluate(base, tokenizer, adapter_dir: str, task, problems: list[dict]) -> float:
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    reward = 0.0
    for problem in problems:
        ids = tokenizer(problem["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=task.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        reward += task.reward(problem, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    model.unload()  # give the base back unchanged for the next version
    return reward / len(problems)


async def main(job: str, n_problems: int) -> None:
    config = load_config()
    client = await BusClient.connect(running_nats_url(config), store_url=config.resolved_store_url)
    task = get_task((await client.status(job))[0].task)
    problems = task.problems(n_problems, seed=12345)  # a fixed held-out set
    base = AutoModelForCausalLM.from_pretrained(config.base_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.base_model_dir)
    async for event in client.events(job):
        if isinstance(event, PolicyCommitted):
            with tempfile.TemporaryDirectory() as adapter_dir:
                try:
                    await client.pull_adapter(event, adapter_dir)
                except AdapterGone:  # replaying an old version that garbage collection removed
                    print(f"version {event.version}: no longer stored", flush=True)
                    continue
                score = evaluate(base, tokenizer, adapter_dir, task, problems)
            print(f"version {event.version}: greedy reward {score:.3f}", flush=True)
    await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("job")
    parser.add_argument("--problems", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.job, args.problems))
