"""Admission by KV-cache budget (MARLaaS section 4.3), as pure functions.

A job's footprint is the KV cache its rollout batch can hold at once: every
sequence of the batch (prompts x group size) at its longest (prompt + max new
tokens), times the bytes one token's keys and values take in every layer. Jobs
are admitted in submission order while the running jobs' footprints fit the
budget; the rest queue. The ``sequential`` schedule admits one job at a time; the
``adaptive`` policy (``adaptive.py``) may hold back jobs that fit.
"""

from __future__ import annotations

import json
from pathlib import Path

from marlaas.platform.events import JobRecord, JobState

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """2 (K and V) x layers x kv heads x head dim x bytes per element."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def job_footprint(prompts: int, group_size: int, prompt_tokens: int, max_new_tokens: int,
                  bytes_per_token: int) -> int:
    return prompts * group_size * (prompt_tokens + max_new_tokens) * bytes_per_token


def to_admit(records: list[JobRecord], budget_bytes: int, schedule: str, limit: int | None = None) -> list[str]:
    """Ids of queued jobs to admit now, oldest first, while they fit next to the running ones
    (and at most ``limit`` of them: the adaptive policy's answer)."""
    running = [r for r in records if r.state is JobState.RUNNING]
    used = sum(r.kv_cache_bytes for r in running)
    slots = 1 - len(running) if schedule == "sequential" else len(records)
    if limit is not None:
        slots = min(slots, limit)
    admitted = []
    for record in sorted((r for r in records if r.state is JobState.QUEUED),
                         key=lambda r: r.spec.submitted_at):
        if slots <= 0 or used + record.kv_cache_bytes > budget_bytes:
            break  # FIFO: a big job at the head is not overtaken by small ones
        admitted.append(record.spec.id)
        used += record.kv_cache_bytes
        slots -= 1
    return admitted
