# over 500 lines: one class, PolicyTrainer; loading, scoring and stepping share its hot adapters' state
"""The trainer's model: one frozen base, one peft LoRA adapter per hot job, per-job AdamW.

The base is loaded once per process and never reloaded per job. A job's adapter
and optimizer state stay in memory while it is hot (most recently trained), so a
step costs a forward/backward and a small state export, not a reload; a cold job
is loaded from the object store at its committed version.

A step is split into micro-batches of at most ``micro_batch_tokens`` padded tokens
with gradient accumulation (exact: see grpo.py), and each micro-batch scores only
its masked-in tokens from the decoder's final hidden states, a chunk of positions at
a time, so memory grows with the budget and a chunk x vocabulary, not with
batch x length x vocabulary. Models whose logits are not ``head(decoder(x))`` (a
probe at start-up checks) are scored from full logits instead, still per micro-batch.
"""

from __future__ import annotations

import gc
import io
import itertools
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from marlaas.platform.adapters import CONFIG_FILE, trained_lora_config
from marlaas.platform.events import GrpoSettings, Sample, TrajectoryBatch
from services.trainer.base_weights import base_digest
from services.trainer.fused_lora import fuse_lora_layers
from services.trainer.grpo import (
    GrpoLoss,
    group_advantages,
    grpo_loss,
    head_logprobs,
    micro_batches,
    scored_positions,
    supervised_loss,
    token_logprobs,
)


def torch_threads(configured: int, device: str, beside_engine: bool) -> int:
    """The trainer's torch threads: ``configured`` when set (not 0); else, on a CPU, every core
    but one while training runs beside the CPU engine (the ``async`` schedule: one job trains
    while others generate), and every core where the two take turns (``sync``, ``sequential``,
    a one-process loop: a core left to an engine that is idle then would idle too). 0 on an
    accelerator: torch's own default. One exception the caller cannot see: ``sync`` with more
    jobs than rollout's ``concurrency`` may sample one round while training another; set
    ``trainer.torch_threads`` for such a deployment."""
    if configured or device != "cpu":
        return configured
    cores = os.cpu_count() or 2
    return max(1, cores - 1) if beside_engine else cores


class NonFiniteUpdate(Exception):
    """The loss or the updated weights are NaN/inf: the version must not be committed."""


def pick_device(name: str) -> torch.device:
    """cpu / cuda / npu; torch_npu is imported only when asked for."""
    if name == "npu":
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device = 'cuda' but torch sees no CUDA device")
    return torch.device(name)


def find_decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, lm_head) of a transformers CausalLM or a peft model around one; None if not found.

    The decoder is the module returning ``last_hidden_state`` (``get_decoder()``, else
    ``.model``); LoRA layers live inside it, so calling it applies the active adapter.
    """
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    get_head = getattr(causal_lm, "get_output_embeddings", None)
    head = get_head() if get_head else None
    decoder = None
    if hasattr(causal_lm, "get_decoder"):
        try:
            decoder = causal_lm.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):  # exotic layouts: try .model
            decoder = None
    if decoder is None or decoder is causal_lm:
        decoder = getattr(causal_lm, "model", None)
    if not isinstance(decoder, torch.nn.Module) or decoder is causal_lm or not isinstance(head, torch.nn.Module):
        return None
    return decoder, head


def head_split_matches(model: torch.nn.Module) -> bool:
    """Whether ``head(decoder(x).last_hidden_state)`` reproduces the model's logits on a probe.

    False for models that post-process logits (softcapping, logit scaling) or whose
    decoder cannot be called alone; those are scored from full logits.
    """
    parts = find_decoder_and_head(model)
    if parts is None:
        return False
    decoder, head = parts
    ids_1_T = torch.arange(8, device=next(model.parameters()).device).unsqueeze(0)
    try:
        with torch.no_grad():
            full = model(input_ids=ids_1_T, use_cache=False).logits.float()
            split = head(decoder(input_ids=ids_1_T, use_cache=False).last_hidden_state).float()
    except (AttributeError, TypeError):  # the decoder is not a plain input_ids -> hidden states module
        return False
    return full.shape == split.shape and torch.allclose(full, split, rtol=1e-3, atol=1e-3)


@dataclass
class Accumulated:
    """A batch in progress: its gradients sit in the job's parameters, its sums here (token sums,
    not yet divided by the batch's token count, which is known only at the step)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loss", "clip_fraction", "kl",
                                                                          "logprob_gap"), 0.0))
    tokens: float = 0.0
    tokens_scored: float = 0.0
    rewards: list[float] = field(default_factory=list)
    groups: set[int] = field(default_factory=set)


@dataclass
class HotJob:
    """A job resident in the trainer: adapter ``slot`` in the peft model at ``version``.

    ``exported`` names each of its parameters as peft's saved state dict does (worked out once at
    load, so an export does not walk every hot job's parameters); ``config_json`` is its PEFT config.
    """

    slot: str
    version: int
    optimizer: torch.optim.AdamW
    params: list[torch.nn.Parameter] = field(default_factory=list)
    exported: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    config_json: bytes = b""
    accumulated: Accumulated | None = None  # a GRPO batch in progress (see PolicyTrainer.add_groups)


@dataclass(frozen=True)
class StepResult:
    """What a training step produced: PEFT files, optimizer bytes and metrics."""

    config_json: bytes
    weights: bytes
    optimizer_state: bytes
    metrics: dict[str, float]


class PolicyTrainer:
    """GRPO updates of many jobs' LoRAs over one shared frozen base model."""

    def __init__(self, base_model_dir: Path, device: str = "cpu", hot_adapters: int = 256,
                 micro_batch_tokens: int = 2048, hot_memory_bytes: int = 4 << 30) -> None:
        self.device = pick_device(device)
        self.base_model_dir = base_model_dir
        self.micro_batch_tokens = micro_batch_tokens
        self.max_hot = hot_adapters
        self.hot_memory_bytes = hot_memory_bytes
        self._slots = itertools.count()
        # held by whoever uses the model: GRPO steps and Tinker requests run in threads of their own
        self.lock = threading.RLock()
        self._load_base()

    def _load_base(self) -> None:
        """The base from disk, frozen, with no job hot; its digest as loaded (``base_weights``)."""
        base = AutoModelForCausalLM.from_pretrained(self.base_model_dir, dtype=torch.float32)
        base.to(self.device)
        base.requires_grad_(False)
        self.base = base
        self.base_digest = base_digest(base)
        self._loaded = (base, self.base_digest)  # read as one by ``base_changed``, which takes no lock
        self.split_head = head_split_matches(base)  # False: score from full logits (still per micro-batch)
        self.model: PeftModel | None = None
        self.hot: OrderedDict[str, HotJob] = OrderedDict()
        self._parked: list[str] = []
        self._tuner_layers: list[BaseTunerLayer] = []  # the LoRA layers (the same objects for every adapter)
        self._active: str | None = None  # the adapter set active by _activate (None: unknown)
        self.pinned: set[str] = set()  # hot jobs never evicted to make room (Tinker models holding gradients)

    # --- the shared base ---------------------------------------------------------------------

    def base_changed(self) -> bool:
        """Whether the base's weights differ from what was loaded (no job may change them). Needs
        no lock: the base is only read, by this and by every step (and while it is reloaded, there is
        nothing to compare: False)."""
        loaded = self._loaded
        return loaded is not None and base_digest(loaded[0]) != loaded[1]

    def reload_base(self) -> list[str]:
        """Load the base again from disk, dropping every hot job (each is loaded again from its
        committed version when next used); returns the jobs dropped. For a base found changed.
        The old base and adapters are let go first: never two bases in memory at once."""
        with self.lock:
            dropped = list(self.hot)
            self._loaded = None
            self.model, self.hot, self.base, self._tuner_layers = None, OrderedDict(), None, []
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._load_base()
            return dropped

    # --- residency ---------------------------------------------------------------------------

    def hot_version(self, job: str) -> int | None:
        """The version the job's in-memory adapter is at (None when the job is not hot)."""
        hot = self.hot.get(job)
        return hot.version if hot else None

    def load(self, job: str, version: int, config_json: bytes, weights: bytes,
             optimizer_state: bytes | None, settings: GrpoSettings) -> None:
        """Make ``job`` hot at ``version`` from its stored adapter (and optimizer, if any)."""
        with self.lock:
            self._load(job, version, config_json, weights, optimizer_state, settings)

    def _load(self, job: str, version: int, config_json: bytes, weights: bytes,
              optimizer_state: bytes | None, settings: GrpoSettings) -> None:
        self.evict(job)
        slot = f"slot{next(self._slots)}"
        config = trained_lora_config(config_json)  # its shape only: never a tenant's init or dropout
        config.inference_mode = False
        self._active = None  # adding and deleting adapters may change peft's active one
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=slot)
        else:
            self.model.add_adapter(slot, config)
            while self._parked:
                self.model.delete_adapter(self._parked.pop())
        # a job may target modules no earlier job did: their new LoRA layers join the list
        self._tuner_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        fuse_lora_layers(self._tuner_layers)
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
        by_storage = {p.data_ptr(): p for p in params}
        exported = {key: by_storage.get(t.data_ptr())
                    for key, t in get_peft_model_state_dict(self.model, adapter_name=slot).items()}
        if None in exported.values():  # something saved that is not one of its parameters: ask peft each time
            exported = {}
        with tempfile.TemporaryDirectory() as tmp:
            self.model.peft_config[slot].save_pretrained(tmp)
            saved_config = (Path(tmp) / CONFIG_FILE).read_bytes()
        self.hot[job] = HotJob(slot, version, optimizer, params, exported, saved_config)
        while len(self.hot) > self.hot_limit(params):
            victim = next((j for j in self.hot if j not in self.pinned and j != job), None)
            if victim is None:
                break
            self.evict(victim)

    def hot_limit(self, params: list[torch.nn.Parameter]) -> int:
        """How many jobs stay hot: ``max_hot``, fewer if that many adapters of this size (weights,
        gradients and AdamW's two moments) would take more than ``hot_memory_bytes``."""
        job_bytes = 4 * sum(p.numel() * p.element_size() for p in params)
        return max(1, min(self.max_hot, self.hot_memory_bytes // max(job_bytes, 1)))

    def evict(self, job: str) -> None:
        """Drop a job's adapter and optimizer from memory (peft needs one adapter left: park it)."""
        with self.lock:
            self.pinned.discard(job)
            hot = self.hot.pop(job, None)
            if hot is None:
                return
            self._drop_slot(hot)

    def _drop_slot(self, hot: HotJob) -> None:
        self._active = None  # deleting the active adapter makes peft pick another
        if len(self.model.peft_config) > 1:
            self.model.delete_adapter(hot.slot)
        else:
            self._parked.append(hot.slot)

    # --- one GRPO step -----------------------------------------------------------------------

    def train_step(self, job: str, batch: TrajectoryBatch, settings: GrpoSettings) -> StepResult:
        """One optimizer step on ``batch``; the job moves to version + 1 in memory."""
        with self.lock:
            self.begin_batch(job)
            self.add_groups(job, batch.samples, settings, batch.policy_version, batch.objective)
            return self.step(job, settings)

    def begin_batch(self, job: str) -> None:
        """Start the job's next batch: zero its gradients and its running sums (call with ``lock``)."""
        hot = self.hot[job]
        hot.optimizer.zero_grad(set_to_none=True)
        hot.accumulated = Accumulated()

    def accumulated(self, job: str) -> Accumulated | None:
        """What the job's batch in progress holds so far (None: the job is not hot, or no batch began)."""
        hot = self.hot.get(job)
        return hot.accumulated if hot else None

    def add_groups(self, job: str, samples: list[Sample], settings: GrpoSettings,
                   sampled_version: int | None = None, objective: str = "grpo") -> None:
        """Add the GRPO gradients of complete groups (every sample of each group present) to the
        job's batch in progress, one micro-batch at a time; call with ``lock`` held.

        The batch's loss is a token sum over the batch's token count N (see grpo.py), and N is
        known only once the last group is in: each micro-batch backpropagates its *sum*
        (``total_tokens=1``), and :meth:`step` divides the gradients and the sums by N, which is
        the same loss and the same gradients as the whole batch at once, up to float rounding
        (``tests/unit/test_pipelined_loss.py``). Advantages are per group, so a group needs
        nothing from the others. Without a KL term, a sample whose advantage is 0 (every sample
        of a group whose rewards are all equal) adds exactly 0 to the loss and to every
        gradient, whatever its logprobs: it is not run through the model at all, but its
        tokens still count in N. ``clip_fraction`` and ``logprob_gap`` are then averages over
        the scored tokens (``tokens_scored``) rather than all ``tokens``. Samples of an older
        version than the job's (``sampled_version``, bounded staleness) are trained with the
        decoupled objective (grpo.py). ``objective = "sft"``: the samples are supervised (their
        masked tokens' cross-entropy, every sample scored; rewards and advantages unused).
        """
        hot = self.hot[job]
        acc = hot.accumulated
        decoupled = sampled_version is not None and 0 <= sampled_version < hot.version
        if acc is None:
            raise RuntimeError(f"add_groups for {job} before begin_batch")
        self.hot.move_to_end(job)
        self._activate(hot.slot)
        for p in hot.params:
            p.requires_grad_(True)
        if not self.model.training:
            self.model.train()
        supervised = objective == "sft"
        rewards_B = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups_B = torch.tensor([s.group for s in samples])
        advantages_B = (torch.zeros_like(rewards_B) if supervised
                        else group_advantages(rewards_B, groups_B, settings.scale_by_std))
        scored = [i for i, a in enumerate(advantages_B.tolist()) if supervised or settings.kl_coef > 0 or a != 0]
        advantages_B = advantages_B.to(self.device)
        lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in scored]
        for rows in micro_batches(lengths, self.micro_batch_tokens):
            picked = [scored[r] for r in rows]
            if supervised:
                out = self._supervised_loss([samples[i] for i in picked], 1.0)
            else:
                out = self._micro_batch_loss([samples[i] for i in picked], advantages_B[picked], 1.0, settings,
                                             decoupled)
            if not torch.isfinite(out.loss):
                raise NonFiniteUpdate(f"loss is {out.loss.item()} at version {hot.version}")
            if out.loss.requires_grad:  # no masked token in this micro-batch: nothing to backpropagate
                out.loss.backward()
            for key, value in (("loss", out.loss.item()), ("clip_fraction", out.clip_fraction),
                               ("kl", out.kl), ("logprob_gap", out.logprob_gap)):
                acc.sums[key] += value
        acc.tokens += float(sum(sum(s.loss_mask) for s in samples))
        acc.tokens_scored += float(sum(sum(samples[i].loss_mask) for i in scored))
        if not supervised:  # a supervised batch has no reward to report
            acc.rewards += [s.reward for s in samples]
        acc.groups.update(s.group for s in samples)

    def accumulate_gradients(self, job: str, batch: TrajectoryBatch, settings: GrpoSettings) -> dict[str, float]:
        """Set the job's gradients to those of the whole batch's GRPO loss, and return the loss
        and its metrics, without stepping (call with ``lock`` held)."""
        self.begin_batch(job)
        self.add_groups(job, batch.samples, settings, batch.policy_version, batch.objective)
        return self.finish_gradients(job)[0]

    def finish_gradients(self, job: str) -> tuple[dict[str, float], Accumulated]:
        """End the job's batch in progress: divide its summed gradients and sums by its token
        count N; return the loss and metrics, and what was accumulated."""
        hot = self.hot[job]
        acc = hot.accumulated
        if acc is None:
            raise RuntimeError(f"finish_gradients for {job} before begin_batch")
        hot.accumulated = None
        tokens = max(acc.tokens, 1.0)
        for p in hot.params:  # a batch with no scored token still steps (AdamW momentum), as before
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.div_(tokens)
        losses = {"loss": acc.sums["loss"] / tokens, "kl": acc.sums["kl"] / tokens,
                  # shares of the scored tokens, not of all N
                  **{k: acc.sums[k] / acc.tokens_scored if acc.tokens_scored else 0.0
                     for k in ("clip_fraction", "logprob_gap")},
                  "tokens": acc.tokens, "tokens_scored": acc.tokens_scored}
        return losses, acc

    def step(self, job: str, settings: GrpoSettings) -> StepResult:
        """Divide the batch's summed gradients by its token count N, clip, take the AdamW step,
        and export; the job moves to version + 1 in memory (call with ``lock`` held)."""
        hot = self.hot[job]
        losses, acc = self.finish_gradients(job)
        grad_norm = torch.nn.utils.clip_grad_norm_(hot.params, settings.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteUpdate(f"gradient norm is {grad_norm.item()} at version {hot.version}")
        hot.optimizer.step()
        if not all(torch.isfinite(p).all() for p in hot.params):
            raise NonFiniteUpdate(f"weights became non-finite after the step at version {hot.version}")
        hot.version += 1
        rewards_B = torch.tensor(acc.rewards, dtype=torch.float32)
        # a batch whose every episode was dropped (grpo.truncated = "drop") has no reward to report
        rewards = {"reward/mean": rewards_B.mean().item(),
                   "reward/std": rewards_B.std(unbiased=False).item()} if acc.rewards else {}
        metrics = {**rewards, **losses, "grad_norm": float(grad_norm)}
        return StepResult(*self.export(job), metrics=metrics)

    def _micro_batch_loss(self, samples: list[Sample], advantages_M: torch.Tensor, total_tokens: float,
                          settings: GrpoSettings, decoupled: bool = False) -> GrpoLoss:
        """These samples' share of the batch loss (their token sums over the batch's ``total_tokens``)."""
        tokens_M_T, mask_M_T, sample_lp_M_T = self._pack(samples)
        ref_lp_M_T = None
        if settings.kl_coef > 0:  # the reference is the base, scored at the same temperature
            with torch.no_grad(), self.model.disable_adapter():
                ref_lp_M_T = self._score(tokens_M_T, mask_M_T, settings.temperature)
        logprobs_M_T = self._score(tokens_M_T, mask_M_T, settings.temperature)
        return grpo_loss(logprobs_M_T, sample_lp_M_T, mask_M_T, advantages_M, settings.clip_eps,
                         settings.kl_coef, ref_lp_M_T, total_tokens=total_tokens, decoupled=decoupled)

    def _supervised_loss(self, samples: list[Sample], total_tokens: float) -> GrpoLoss:
        """These samples' share of a supervised batch's loss (grpo.py's L_sft, scored at tau = 1)."""
        tokens_M_T, mask_M_T, _ = self._pack(samples)
        return supervised_loss(self._score(tokens_M_T, mask_M_T, 1.0), mask_M_T, total_tokens=total_tokens)

    def _score(self, tokens_B_T: torch.Tensor, mask_B_T: torch.Tensor, temperature: float) -> torch.Tensor:
        """Tempered logprobs of the masked-in tokens (0 elsewhere) under the model as it is set.

        No attention mask is passed: rows are right-padded and the model is causal, so every
        real token precedes the padding and attends to none of it, and positions count from 0
        as they do unpadded. The pads' own outputs are never scored. Without a padding mask the
        attention runs its plain causal kernel (~4 % of a step on CPU).
        """
        parts = find_decoder_and_head(self.model) if self.split_head else None
        if parts is None:
            logits_B_T_V = self.model(input_ids=tokens_B_T, use_cache=False).logits
            return token_logprobs(logits_B_T_V, tokens_B_T, temperature)
        decoder, head = parts
        hidden_B_T_H = decoder(input_ids=tokens_B_T, use_cache=False).last_hidden_state
        rows_N, cols_N = scored_positions(mask_B_T)
        logprobs_N = head_logprobs(hidden_B_T_H[rows_N, cols_N - 1], tokens_B_T[rows_N, cols_N],
                                   head, temperature)
        return torch.zeros(mask_B_T.shape, device=self.device).index_put((rows_N, cols_N), logprobs_N)

    def _activate(self, slot: str) -> None:
        """Make ``slot`` the adapter of the forward pass, in time independent of how many jobs are hot.

        ``PeftModel.set_adapter`` walks every module of the model, and each LoRA layer's
        ``set_adapter`` then sets ``requires_grad`` on every hot job's matrices: 27 ms a switch
        with 32 jobs hot, 10 % of a step. What the forward pass reads is the layer's active
        adapter list (``_active_adapter``, peft's own record), so only that is set here; the
        job's own parameters are made trainable by the caller, and another job's never enter
        the graph (``test_jobs_keep_separate_adapters``)."""
        if self._active == slot:
            return
        for layer in self._tuner_layers:
            layer._active_adapter = [slot]
        self.model.base_model.active_adapter = slot
        self._active = slot

    def export(self, job: str) -> tuple[bytes, bytes, bytes]:
        """The hot job's adapter as PEFT files (config JSON, safetensors) and its optimizer state."""
        with self.lock:
            return self._export(self.hot[job])

    def _export(self, hot: HotJob) -> tuple[bytes, bytes, bytes]:
        state = hot.exported or get_peft_model_state_dict(self.model, adapter_name=hot.slot)
        weights = save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
        buf = io.BytesIO()
        torch.save(hot.optimizer.state_dict(), buf)
        return hot.config_json, weights, buf.getvalue()

    # --- the Tinker API's primitives (services/trainer/tinker_training.py; call with ``lock`` held) ------

    def target_logprobs(self, job: str, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """For each (tokens_T, targets_T) row, log p(targets_T[t] | tokens_T[:t+1]) under the job's
        adapter, all rows in one right-padded pass (causal: no row attends to its padding);
        differentiable unless the caller disabled gradients."""
        hot = self.hot[job]
        self.hot.move_to_end(job)
        self._activate(hot.slot)
        for p in hot.params:
            p.requires_grad_(True)
        if not self.model.training:
            self.model.train()
        lengths = [tokens_T.numel() for tokens_T, _ in rows]
        tokens_B_T = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        targets_B_T = torch.zeros_like(tokens_B_T)
        for i, (tokens_T, targets_T) in enumerate(rows):
            tokens_B_T[i, : lengths[i]], targets_B_T[i, : lengths[i]] = tokens_T, targets_T
        mask_B_T = torch.arange(tokens_B_T.shape[1]) < torch.tensor(lengths).unsqueeze(1)
        tokens_B_T, targets_B_T, mask_B_T = (tokens_B_T.to(self.device), targets_B_T.to(self.device),
                                             mask_B_T.to(self.device))
        rows_N, cols_N = mask_B_T.nonzero(as_tuple=True)  # row-major: each row's positions in order
        parts = find_decoder_and_head(self.model) if self.split_head else None
        if parts is None:
            logits_N_V = self.model(input_ids=tokens_B_T, use_cache=False).logits[rows_N, cols_N].float()
            logprobs_N = torch.log_softmax(logits_N_V, dim=-1).gather(-1, targets_B_T[rows_N, cols_N].unsqueeze(-1))
            logprobs_N = logprobs_N.squeeze(-1)
        else:
            decoder, head = parts
            hidden_B_T_H = decoder(input_ids=tokens_B_T, use_cache=False).last_hidden_state
            logprobs_N = head_logprobs(hidden_B_T_H[rows_N, cols_N], targets_B_T[rows_N, cols_N], head, 1.0)
        return list(torch.split(logprobs_N, lengths))

    def gradients(self, job: str) -> list[torch.Tensor | None]:
        """A copy of the job's accumulated gradients (LoRA-sized: cheap), to undo a failed request's."""
        return [None if p.grad is None else p.grad.clone() for p in self.hot[job].params]

    def restore_gradients(self, job: str, saved: list[torch.Tensor | None]) -> None:
        for p, grad in zip(self.hot[job].params, saved, strict=True):
            p.grad = grad

    def drop_gradients(self, job: str) -> None:
        """Forget the job's accumulated gradients, and unpin it."""
        for p in self.hot[job].params:
            p.grad = None
        self.pinned.discard(job)

    def adam_step(self, job: str, learning_rate: float, betas: tuple[float, float], eps: float,
                  weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last one (none: a step on zeros,
        which still moves the moments), with the caller's hyperparameters; then zero them."""
        hot = self.hot[job]
        for p in hot.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for group in hot.optimizer.param_groups:
            group.update(lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
        max_norm = grad_clip_norm if grad_clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(hot.params, max_norm)
        if not torch.isfinite(grad_norm):
            hot.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate(f"gradient norm is {grad_norm.item()}: the step was not taken")
        hot.optimizer.step()
        hot.optimizer.zero_grad(set_to_none=True)
        hot.version += 1
        return {"grad_norm": float(grad_norm)}

    def _pack(self, samples: list[Sample]):
        """Right-pad prompt + completion into tensors; the mask covers trained completion tokens."""
        rows = [s.prompt_ids + s.completion_ids for s in samples]
        width = max(len(r) for r in rows)
        B = len(rows)
        tokens_B_T = torch.zeros(B, width, dtype=torch.long)
        mask_B_T = torch.zeros(B, width)
        sample_lp_B_T = torch.zeros(B, width)
        for i, s in enumerate(samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            tokens_B_T[i, : p + c] = torch.tensor(rows[i])
            mask_B_T[i, p : p + c] = torch.tensor(s.loss_mask, dtype=torch.float32)
            if s.logprobs:  # a supervised sample has none (nothing sampled it)
                sample_lp_B_T[i, p : p + c] = torch.tensor(s.logprobs, dtype=torch.float32)
        d = self.device
        return tokens_B_T.to(d), mask_B_T.to(d), sample_lp_B_T.to(d)
