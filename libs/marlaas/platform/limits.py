"""The platform's bounds on what a job and a tenant's input may be, one home for them (issue 36):
the manager validates a job against them (``services/manager/validation.py``), the gateway checks
version numbers, sampling seeds and the nesting of request bodies by them.

NATS messages (issue 49): the broker's bound on one message, and a tenant account's, are set here
and only here; the broker's configs are written from them (or, for the static files under
``deploy/``, held to them by a test), and every size that must fit one message is checked
against them (``tests/unit/test_layout.py``).

Error texts (issue 35): a tenant's reward, tool or request can fail with any text; what is kept
of it (a job's failure reason, a queued note, a Tinker future's error, a failure event on the
JOBS stream) is read by every listing, the dashboard and ``/metrics``, so it is cut to one bound
here, saying how much was cut.

Per-tenant and per-stack bounds that an operator sets are in ``marlaas.platform.config``;
docs/tenants.md lists them all.
"""

from __future__ import annotations

MAX_ERROR_CHARS = 2_000  # a failure reason, note or error text, as stored or published
MAX_STEPS = 100_000  # a job's steps, so its versions are 0 .. MAX_STEPS (the gateway checks version numbers by it)
MAX_JOB_SEED = 2**63 - 1  # a job's seed: a signed 64-bit integer, as numpy and torch take it
# the range of sampling temperatures a job may ask: random sampling only (greedy has no logprobs to
# train on), and not so flat or so sharp that float32 logprobs of engine and trainer drift apart
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 5.0
# upper bounds of a job's other numbers: generous for real jobs, and within what torch, peft and vLLM take
MAX_PROMPTS_PER_STEP, MAX_GROUP_SIZE = 4096, 1024
# grpo.pipeline = "groups": a batch of more groups than this travels whole (the trainer holds each
# group of a batch in progress unacked; see services/trainer/service.py)
MAX_PIPELINED_GROUPS = 256
MAX_STALENESS = 4  # grpo.max_staleness: how far behind the trained version a batch's sampler may be
MAX_LORA_ALPHA = 4096
MAX_NAME_CHARS = 64
MAX_EVAL_PROBLEMS = 1000
# a Tinker sampling seed is 0 .. MAX_SAMPLING_SEED - 1 (the engine's generators overflow past 64
# bits, and each of a request's samples takes seed + its index)
MAX_SAMPLING_SEED = 2**31
# levels of arrays / objects (TOML tables too) in a request body the gateway reads: a job needs 3, the
# SDKs' deepest body under 10; deeper is a 400 before the work (and recursion) a hostile body would cause
MAX_JSON_NESTING = 32


# the broker's max_payload: any one message on it (the embedded server's config, marlaas.stack.embedded_nats;
# deploy/nats/marlaas.conf says 8MB, nats-server's MB being MiB). The services read it back from the server
# (bus.nc.max_payload) where a message's size depends on a job's settings
MAX_MESSAGE_BYTES = 8 << 20
# a tenant account's max_payload (auth.conf, marlaas.stack.broker_auth): a tool's or reward's answer,
# an announcement, anything a tenant's own process publishes
MAX_TENANT_MESSAGE_BYTES = 1 << 20
# one Tinker request the gateway takes: queued base64 in JSON, so about 4/3 of it is one message. It was
# sized for a 1 MiB message; MAX_MESSAGE_BYTES would take more, but raising it changes what is accepted
MAX_TINKER_REQUEST_BYTES = 640 * 1024

# each version's rollouts kept for their tenant (``marlaas.platform.samples``): per version, the first
# MAX_SAMPLE_GROUPS GRPO groups, the first MAX_SAMPLE_EPISODES episodes of each (as many as fit in
# MAX_SAMPLE_GROUP_CHARS of text, one at least), each text (prompt, turn, completion) cut to
# MAX_SAMPLE_TEXT_CHARS and each episode to its first MAX_SAMPLE_TURNS turns before its answer
MAX_SAMPLE_GROUPS, MAX_SAMPLE_EPISODES = 8, 8
MAX_SAMPLE_TEXT_CHARS, MAX_SAMPLE_TURNS, MAX_SAMPLE_GROUP_CHARS = 2_000, 16, 64_000
MAX_SAMPLE_FILE_BYTES = 1024 * 1024  # a stored group record the gateway reads (a larger one is skipped)
# which versions' samples stay: the last FULL_SAMPLE_VERSIONS, and of the older ones at most
# OLDER_SAMPLE_VERSIONS, evenly spaced (every 1st, 2nd, 4th, ... version: the spacing doubles as the job grows)
FULL_SAMPLE_VERSIONS, OLDER_SAMPLE_VERSIONS = 8, 16


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` kept to ``limit`` characters, saying how many were cut (so nobody takes it for whole)."""
    if len(text) <= limit:
        return text
    marker = f" ... [{len(text) - limit} more characters cut]"
    return text[:max(limit - len(marker), 0)] + marker

MAX_SFT_EPOCHS = 1000  # times an sft job goes through its conversations
