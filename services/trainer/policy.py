"""The trainer's model: one frozen base, one peft LoRA adapter per hot job, per-job AdamW.

The base is loaded once per process and never reloaded per job. A job's adapter
and optimizer state stay in memory while it is hot (most recently trained), so a
step costs a forward/backward and a small state export, not a reload; a cold job
is loaded from the object store at its committed version.
"""

from __future__ import annotations

import io
import itertools
import json
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from marlaas.adapters import CONFIG_FILE
from marlaas.events import GrpoSettings, TrajectoryBatch
from services.trainer.grpo import group_advantages, grpo_loss, token_logprobs


class NonFiniteUpdate(Exception):
    """The loss or the updated weights are NaN/inf: the version must not be committed."""


def pick_device(name: str) -> torch.device:
    """cpu / cuda / npu; torch_npu is imported only when asked for."""
    if name == "npu":
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device = 'cuda' but torch sees no CUDA device")
    return torch.device(name)


@dataclass
class HotJob:
    """A job resident in the trainer: adapter ``slot`` in the peft model at ``version``."""

    slot: str
    version: int
    optimizer: torch.optim.AdamW
    params: list[torch.nn.Parameter] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """What a training step produced: PEFT files, optimizer bytes and metrics."""

    config_json: bytes
    weights: bytes
    optimizer_state: bytes
    metrics: dict[str, float]


class PolicyTrainer:
    """GRPO updates of many jobs' LoRAs over one shared frozen base model."""

    def __init__(self, base_model_dir: Path, device: str = "cpu", hot_adapters: int = 16) -> None:
        self.device = pick_device(device)
        base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
        base.to(self.device)
        base.requires_grad_(False)
        self.base = base
        self.model: PeftModel | None = None
        self.hot: OrderedDict[str, HotJob] = OrderedDict()
        self.max_hot = hot_adapters
        self._slots = itertools.count()
        self._parked: list[str] = []

    # --- residency ---------------------------------------------------------------------------

    def hot_version(self, job: str) -> int | None:
        hot = self.hot.get(job)
        return hot.version if hot else None

    def load(self, job: str, version: int, config_json: bytes, weights: bytes,
             optimizer_state: bytes | None, settings: GrpoSettings) -> None:
        """Make ``job`` hot at ``version`` from its stored adapter (and optimizer, if any)."""
        self.evict(job)
        slot = f"slot{next(self._slots)}"
        config = LoraConfig(**{k: v for k, v in json.loads(config_json).items()
                               if k in LoraConfig.__dataclass_fields__})
        config.inference_mode = False
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=slot)
        else:
            self.model.add_adapter(slot, config)
            while self._parked:
                self.model.delete_adapter(self._parked.pop())
        try:
            state = {k: v.to(self.device) for k, v in load_safetensors(weights).items()}
            result = set_peft_model_state_dict(self.model, state, adapter_name=slot)
            missing = [k for k in result.missing_keys if "lora_" in k and f".{slot}." in k]
            if missing:
                raise ValueError(f"adapter for {job} v{version} lacks weights: {missing[:3]}")
        except BaseException:
            self._parked.append(slot)  # drop the half-loaded slot with the next load
            raise
        params = [p for n, p in self.model.named_parameters() if f".{slot}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=settings.learning_rate,
                                      weight_decay=settings.weight_decay)
        if optimizer_state:
            optimizer.load_state_dict(torch.load(io.BytesIO(optimizer_state), weights_only=True))
        self.hot[job] = HotJob(slot, version, optimizer, params)
        while len(self.hot) > self.max_hot:
            self.evict(next(iter(self.hot)))

    def evict(self, job: str) -> None:
        """Drop a job's adapter and optimizer from memory (peft needs one adapter left: park it)."""
        hot = self.hot.pop(job, None)
        if hot is None:
            return
        if len(self.model.peft_config) > 1:
            self.model.delete_adapter(hot.slot)
        else:
            self._parked.append(hot.slot)

    # --- one GRPO step -----------------------------------------------------------------------

    def train_step(self, job: str, batch: TrajectoryBatch, settings: GrpoSettings) -> StepResult:
        """One optimizer step on ``batch``; the job moves to version + 1 in memory."""
        hot = self.hot[job]
        self.hot.move_to_end(job)
        model = self.model
        model.set_adapter(hot.slot)
        for p in hot.params:
            p.requires_grad_(True)
        model.train()
        tokens_B_T, mask_B_T, sample_lp_B_T, attn_B_T = self._pack(batch)
        rewards_B = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
        groups_B = torch.tensor([s.group for s in batch.samples])
        advantages_B = group_advantages(rewards_B, groups_B, settings.scale_by_std).to(self.device)

        ref_lp_B_T = None
        if settings.kl_coef > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_lp_B_T = token_logprobs(model(input_ids=tokens_B_T, attention_mask=attn_B_T).logits, tokens_B_T)
        logits = model(input_ids=tokens_B_T, attention_mask=attn_B_T).logits
        logprobs_B_T = token_logprobs(logits, tokens_B_T)
        out = grpo_loss(logprobs_B_T, sample_lp_B_T, mask_B_T, advantages_B,
                        settings.clip_eps, settings.kl_coef, ref_lp_B_T)
        if not torch.isfinite(out.loss):
            raise NonFiniteUpdate(f"loss is {out.loss.item()} at version {hot.version}")
        hot.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(hot.params, settings.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteUpdate(f"gradient norm is {grad_norm.item()} at version {hot.version}")
        hot.optimizer.step()
        if not all(torch.isfinite(p).all() for p in hot.params):
            raise NonFiniteUpdate(f"weights became non-finite after the step at version {hot.version}")
        hot.version += 1
        metrics = {
            "reward/mean": rewards_B.mean().item(),
            "reward/std": rewards_B.std(unbiased=False).item(),
            "loss": out.loss.item(),
            "clip_fraction": out.clip_fraction,
            "kl": out.kl,
            "logprob_gap": out.logprob_gap,
            "grad_norm": float(grad_norm),
            "tokens": float(mask_B_T.sum().item()),
        }
        return StepResult(*self.export(job), metrics=metrics)

    def export(self, job: str) -> tuple[bytes, bytes, bytes]:
        """The hot job's adapter as PEFT files (config JSON, safetensors) and its optimizer state."""
        hot = self.hot[job]
        state = get_peft_model_state_dict(self.model, adapter_name=hot.slot)
        weights = save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
        with tempfile.TemporaryDirectory() as tmp:
            self.model.peft_config[hot.slot].save_pretrained(tmp)
            config_json = (Path(tmp) / CONFIG_FILE).read_bytes()
        buf = io.BytesIO()
        torch.save(hot.optimizer.state_dict(), buf)
        return config_json, weights, buf.getvalue()

    def _pack(self, batch: TrajectoryBatch):
        """Right-pad prompt + completion into tensors; the mask covers trained completion tokens."""
        rows = [s.prompt_ids + s.completion_ids for s in batch.samples]
        width = max(len(r) for r in rows)
        B = len(rows)
        tokens_B_T = torch.zeros(B, width, dtype=torch.long)
        attn_B_T = torch.zeros(B, width, dtype=torch.long)
        mask_B_T = torch.zeros(B, width)
        sample_lp_B_T = torch.zeros(B, width)
        for i, s in enumerate(batch.samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            tokens_B_T[i, : p + c] = torch.tensor(rows[i])
            attn_B_T[i, : p + c] = 1
            mask_B_T[i, p : p + c] = torch.tensor(s.loss_mask, dtype=torch.float32)
            sample_lp_B_T[i, p : p + c] = torch.tensor(s.logprobs, dtype=torch.float32)
        d = self.device
        return tokens_B_T.to(d), mask_B_T.to(d), sample_lp_B_T.to(d), attn_B_T.to(d)

