"""Invariant 1 as a hypothesis state machine over the project's own commit protocol.

Everything is the real code on a real nats-server and file store: the manager (submission,
version 0, following announcements), two trainers (``Trainer.handle`` over a real
``PolicyTrainer`` each, on the built-in tiny base) sharing one TRAJ consumer as replicas do,
and rollout's reaction to an announcement (``plan_announcement``, then ``publish_batch`` and
``record_sampled``, in the order ``Rollout.handle`` runs them). Only the sampling itself is
stood in for: vLLM is not started, a sampled batch is one fixed group of synthetic tokens.

Each step is one move: rollout applies the next announcements (the last one's ack may be lost,
so it comes again); trainer A trains the next batch, perhaps crashing right after writing the
adapter or right after the compare-and-set (the batch is redelivered, as after AckWait); A
restarts (nothing in memory, re-announces what is committed); trainer B takes the next batch
and holds it, having read the committed version and its revision, while the rest goes on, then
finishes (the racing commit from an old revision); an earlier announcement or batch arrives
again (a copy past the duplicate window, or an older one after newer ones); the committed
version is announced again inside the window (dropped by the broker).

After every move: the committed version rose by at most one, version v+1 made from batch v;
the job's announcements are versions 0..n once each, in order, with n the committed version
(or one less, only while a crash's lost announcement is unrecovered); no version sampled
twice, none before it was committed; the manager's record never ahead, one reward per version.
Each run then drives the job to its last step and checks that every version was committed,
announced, sampled and trained once, from its own committed adapter, retrained only after an
attempt that was not committed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import Counter

import msgspec
import nats.errors
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

import services.trainer.service as trainer_service
from marlaas.basemodel import builtin_model_dir
from marlaas.platform import api, subjects
from marlaas.platform.audit import audit_training
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus, Delivery
from marlaas.platform.commits import announce, read_job
from marlaas.platform.config import load_config
from marlaas.platform.events import (
    COMMITTED,
    JOB_RECORD,
    METRIC,
    POLICY,
    TRAJECTORY,
    JobState,
    Sample,
    TrajectoryBatch,
    encode,
)
from marlaas.platform.store import FileStore
from services.manager.job_admin import cancel_job
from services.manager.service import Manager
from services.rollout.announcements import Reaction, plan_announcement
from services.rollout.service import publish_batch, record_sampled, sampled_version
from services.trainer.policy import PolicyTrainer
from services.trainer.service import Trainer

pytestmark = pytest.mark.timeout(600)  # a failure shrinks for up to 5 minutes

STEPS = 4  # versions each run drives its job to
AFTER_WRITE, AFTER_CAS = "written, not committed", "committed, not announced"  # the trainer's crash points
EXAMPLES = settings(max_examples=25, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# the pipeline's own moves weigh double (without them nothing happens for the faults to hit),
# and so does B's taking a batch (the race needs B holding one while A commits)
MOVES = (["rollout_applies_the_next_announcements"] * 2 + ["trainer_a_trains_the_next_batch"] * 2
         + ["trainer_b_takes_the_next_batch_and_holds_it"] * 2
         + ["trainer_a_restarts", "trainer_b_finishes", "an_announcement_is_sent_again", "a_batch_arrives_again"])


class SimulatedCrash(BaseException):
    """The trainer process dying at one of its crash points (SIGKILL in a chaos run): nothing
    after it runs, and the batch it held is never settled."""


class Settled(Delivery):
    """A delivery that remembers how the handler settled it. Its ack and term wait for the
    server's confirmation (the service's are fire-and-forget), so the consumer's counts are
    current when the handler returns."""

    def __init__(self, msg: Msg, nc) -> None:
        super().__init__(msg)
        self.nc, self.outcome = nc, ""

    async def ack(self) -> None:
        self.settled, self.outcome = True, "ack"
        await self.msg.ack_sync()

    async def nak(self, delay_s: float | None = None) -> None:
        self.outcome = "nak"
        await super().nak(delay_s)

    async def term(self) -> None:
        self.settled, self.outcome = True, "term"
        await self.nc.request(self.msg.reply, Msg.Ack.Term, timeout=5)


async def hand_over(handler, bus: Bus, msg: Msg) -> Settled:
    """Run a handler as the consume loop does (returning unsettled acks). A simulated crash
    leaves the message to AckWait, stood in for by an immediate redelivery."""
    delivery = Settled(msg, bus.nc)
    try:
        await handler(delivery)
    except SimulatedCrash:
        await msg.nak()
        delivery.outcome = "crashed"
        return delivery
    if not delivery.settled:
        await delivery.ack()
    return delivery


async def next_message(sub, held: int = 0):
    """The consumer's next message, or None when it has none to give: every message handed out
    here is settled before the next is asked for, except the ``held`` ones (a nak'd message
    counts as ack-pending until it is redelivered)."""
    info = await sub.consumer_info()
    if info.num_pending + info.num_ack_pending <= held:
        return None
    try:
        [msg] = await sub.fetch(1, timeout=2)
    except (TimeoutError, nats.errors.TimeoutError):
        return None
    return msg


async def pending_messages(sub) -> list:
    """Every message the consumer has not delivered yet (acked as read)."""
    pending = (await sub.consumer_info()).num_pending
    msgs = await sub.fetch(pending, timeout=2) if pending else []
    for msg in msgs:
        await msg.ack_sync()
    return msgs


def synthetic_batch(version: int) -> TrajectoryBatch:
    """What rollout would have sampled with ``version``: one group, one rewarded completion."""
    return TrajectoryBatch(policy_version=version, samples=[
        Sample(group=0, prompt_ids=[10, 11, 12], completion_ids=[5 + i, 6], logprobs=[-1.0, -1.0],
               loss_mask=[1, 1], reward=float(i == 0))
        for i in range(2)])


class World:
    """What every run shares: one event loop, bus, store, manager and two trainers' models."""

    def __init__(self, url: str, home) -> None:
        self.loop = asyncio.new_event_loop()
        self.bus = self.run(Bus.connect(url, name="state-machine"))
        self.run(self.bus.ensure_topology())
        self.store = FileStore(home / "store")
        self.manager = Manager(self.bus, self.store, load_config(overrides={"home": str(home)}, env={}))
        base = builtin_model_dir()
        self.policy_a = PolicyTrainer(base, hot_adapters=2)  # small: earlier runs' jobs are evicted
        self.policy_b = PolicyTrainer(base, hot_adapters=2)
        self.gate, self.at_gate = threading.Event(), threading.Event()
        train_step = self.policy_b.train_step

        def held_train_step(*args):  # B holds here, having read the version (and revision) it trains on
            self.at_gate.set()
            assert self.gate.wait(60), "trainer B was never released"
            return train_step(*args)

        self.policy_b.train_step = held_train_step
        self.crash_point: str | None = None
        self.runs = itertools.count()
        self.seen: Counter = Counter()  # what the runs exercised, across all of them

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def maybe_crash(self, *args) -> None:
        """Stands in for the trainer's fault hook: the crash point armed by a rule raises."""
        if args[-1] == self.crash_point:
            self.crash_point = None
            raise SimulatedCrash(args[-1])

    async def submit(self, seed: int) -> str:
        request = {"task": "addition", "steps": STEPS, "seed": seed, "tenant": "sm", "name": f"sm-{seed}",
                   "grpo": {"prompts_per_step": 1, "group_size": 2, "learning_rate": 1e-2},
                   "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}}
        reply = await self.manager.submissions.submit(msgspec.json.encode(request))
        assert not reply.error, reply.error
        return reply.id

    def close(self) -> None:
        self.gate.set()

        async def manager_idle() -> None:  # its garbage-collection passes, which announcements start
            await asyncio.gather(*list(self.manager.jobs.background), return_exceptions=True)

        self.run(manager_idle())
        self.run(self.bus.close())
        self.run(self.loop.shutdown_default_executor())
        self.loop.close()


def machine_over(world: World) -> type[RuleBasedStateMachine]:  # noqa: C901 -- the nested class's rules, each small
    run = world.run
    bus = world.bus

    class VersionStateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.n = next(world.runs)
            self.job = run(world.submit(self.n))
            self.consumers = [("POLICY", f"rollout-{self.n}"), ("POLICY", f"audit-{self.n}"),
                              ("METRICS", f"spans-{self.n}"), ("TRAJ", f"trainers-{self.n}")]
            self.subs = [run(self.subscribe(stream, durable, subject)) for (stream, durable), subject in zip(
                self.consumers, (subjects.policy_committed(self.job), subjects.policy_committed(self.job),
                                 subjects.span(self.job), f"marlaas.trajectory.ready.{self.job}"))]
            self.rollout_sub, self.audit_sub, self.spans_sub, self.trainers_sub = self.subs
            self.trainer_a = Trainer(bus, world.store, world.policy_a)
            self.trainer_b = Trainer(bus, world.store, world.policy_b)
            self.committed = 0
            self.announced: list[int] = []  # versions the services announced (copies left out), in order
            self.announcements: list[bytes] = []
            self.batches: list[bytes] = []  # every batch message handed to a trainer
            self.sampled: Counter = Counter()
            self.discarded: Counter = Counter()  # per version: trained attempts that were not committed
            self.a_down = False
            self.unannounced = False  # a crash lost the announcement of the committed version
            self.b_task: asyncio.Task | None = None
            self.b_version = -1

        async def subscribe(self, stream: str, durable: str, subject: str):
            config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=300)
            return await bus.js.pull_subscribe(subject, durable=durable, stream=stream, config=config)

        # --- what can happen next ------------------------------------------------------------

        @rule(move=st.sampled_from(MOVES), data=st.data())
        def next_move(self, move: str, data) -> None:
            """One move per step, drawn from one rule: hypothesis' swarm testing switches whole
            rules off for a run, which must never switch off the pipeline itself."""
            getattr(self, move)(data)

        def rollout_applies_the_next_announcements(self, data) -> None:
            """Up to three announcements, in the order the broker delivers them; the last one's ack
            may be lost (the broker delivers it again)."""
            count = data.draw(st.integers(1, 3), label="announcements")
            ack_lost = data.draw(st.booleans(), label="last ack lost")
            for i in range(count):
                if not run(self.apply_next_announcement(ack_lost and i == count - 1)):
                    return

        async def apply_next_announcement(self, ack_lost: bool = False) -> bool:
            msg = await next_message(self.rollout_sub)
            if msg is None:
                return False
            event = POLICY.decode(msg.data)
            state = await read_job(bus, self.job)
            plan = plan_announcement(event.version, state.record, state.committed.version,
                                     await sampled_version(bus, self.job), False)
            world.seen[f"announcement: {plan.reaction.value}"] += 1
            if plan.reaction is Reaction.SAMPLE:
                self.sampled[event.version] += 1
                await publish_batch(bus, world.store, self.job, event.version, synthetic_batch(event.version))
                await record_sampled(bus, self.job, event.version)
            await world.manager.events.on_policy(Delivery(msg))
            await (msg.nak() if ack_lost else msg.ack_sync())
            return True

        def an_announcement_is_sent_again(self, data) -> None:
            """Inside the duplicate window: the committed version announced again (the broker drops
            it if it is out already). Past it: a copy of any earlier announcement, the current or an
            older one (the extra field marks it for this test; the services ignore unknown fields)."""
            if not data.draw(st.booleans(), label="past the window") or not self.announcements:
                entry = run(bus.kv_get(VERSIONS_BUCKET, self.job))
                run(announce(bus, COMMITTED.decode(entry.value)))
                return
            raw = data.draw(st.sampled_from(self.announcements), label="announcement")
            run(bus.publish(subjects.policy_committed(self.job),
                            json.dumps({**json.loads(raw), "copy": True}).encode()))

        def trainer_a_trains_the_next_batch(self, data) -> None:
            if not self.a_down:
                run(self.a_trains_next(data.draw(st.sampled_from([None, AFTER_WRITE, AFTER_CAS]), label="crash")))

        async def a_trains_next(self, crash: str | None = None) -> bool:
            msg = await next_message(self.trainers_sub, held=self.b_task is not None)
            if msg is None:
                return False
            self.note_batch(msg.data)
            world.crash_point = crash
            try:
                delivery = await hand_over(self.trainer_a.handle, bus, msg)
            finally:
                world.crash_point = None
            world.seen[f"trainer A: {delivery.outcome}"] += 1
            if delivery.outcome == "crashed":
                self.a_down = True
                world.seen[f"crash: {crash}"] += 1
                if crash == AFTER_WRITE:
                    self.discarded[TRAJECTORY.decode(msg.data).version] += 1
                else:
                    self.unannounced = True
            return True

        def trainer_a_restarts(self, data) -> None:
            run(self.restart_a())

        async def restart_a(self) -> None:
            for job in list(world.policy_a.hot):  # a new process: nothing in memory
                world.policy_a.evict(job)
            self.trainer_a = Trainer(bus, world.store, world.policy_a)
            await self.trainer_a.reannounce_committed()
            self.a_down = False
            await self.check()
            assert len(self.announced) == self.committed + 1, "a restart re-announces what is committed"

        def trainer_b_takes_the_next_batch_and_holds_it(self, data) -> None:
            """B takes the next batch and holds it after reading the committed version and its
            revision; if it is an AckWait redelivery, a copy stays in the queue (for A)."""
            if self.b_task is not None:
                return
            msg = run(next_message(self.trainers_sub))
            if msg is None:
                return
            self.note_batch(msg.data)
            if data.draw(st.booleans(), label="a copy stays queued"):
                run(bus.publish(f"marlaas.trajectory.ready.{self.job}", msg.data))
            world.gate.clear()
            world.at_gate.clear()
            task = world.loop.create_task(hand_over(self.trainer_b.handle, bus, msg))

            async def held_or_done() -> None:
                while not (world.at_gate.is_set() or task.done()):
                    await asyncio.sleep(0.005)

            run(asyncio.wait_for(held_or_done(), 30))
            if world.at_gate.is_set():
                self.b_task, self.b_version = task, TRAJECTORY.decode(msg.data).version
            else:
                world.seen[f"trainer B: {run(task).outcome} (not trained)"] += 1

        def trainer_b_finishes(self, data) -> None:
            if self.b_task is not None:
                run(self.release_b())

        async def release_b(self) -> None:
            task, self.b_task = self.b_task, None
            world.gate.set()
            outcome = (await task).outcome
            world.seen[f"trainer B after holding: {outcome}"] += 1
            if outcome == "term":  # lost the race (or the job ended meanwhile): nothing committed
                self.discarded[self.b_version] += 1
            else:
                assert outcome == "ack", outcome

        def a_batch_arrives_again(self, data) -> None:
            """A copy of a batch already handed out (an AckWait redelivery, a re-sample past the window)."""
            if self.batches:
                raw = data.draw(st.sampled_from(self.batches), label="batch")
                run(bus.publish(f"marlaas.trajectory.ready.{self.job}", raw))

        def note_batch(self, raw: bytes) -> None:
            if raw not in self.batches:
                self.batches.append(raw)

        # --- invariants ----------------------------------------------------------------------

        @invariant()
        def versions_rise_by_one_and_are_announced_without_gaps(self) -> None:
            world.seen["steps"] += 1
            run(self.check())

        async def check(self) -> None:
            committed = COMMITTED.decode((await bus.kv_get(VERSIONS_BUCKET, self.job)).value)
            assert committed.version in (self.committed, self.committed + 1), (self.committed, committed.version)
            if committed.version == self.committed + 1:
                assert committed.batch_id == f"{self.job}:v{self.committed}"  # v+1 is made from batch v
            self.committed = committed.version
            for msg in await pending_messages(self.audit_sub):
                if not json.loads(msg.data).get("copy"):
                    self.announced.append(POLICY.decode(msg.data).version)
                    self.announcements.append(msg.data)
            assert self.announced == list(range(len(self.announced))), self.announced  # once each, no gap
            if len(self.announced) == self.committed + 1:
                self.unannounced = False
            else:
                assert self.unannounced and len(self.announced) == self.committed, (self.announced, self.committed)
            assert all(n == 1 for n in self.sampled.values()), self.sampled
            assert all(v <= self.committed for v in self.sampled)
            record = JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, self.job)).value)
            assert record.version <= self.committed and len(record.rewards) == max(record.version, 0)

        # --- each run ends by finishing its job ----------------------------------------------

        def teardown(self) -> None:
            try:
                run(self.finish())
            finally:
                world.gate.set()
                if self.b_task is not None:
                    run(asyncio.wait([self.b_task], timeout=30))
                run(self.clean_up())

        async def finish(self) -> None:
            if self.b_task is not None:
                await self.release_b()
            await self.restart_a()
            for _ in range(4 * STEPS + 8):
                moved = False
                while await self.apply_next_announcement():
                    moved = True
                while await self.a_trains_next():
                    moved = True
                await self.check()
                if not moved:
                    break
            assert self.committed == STEPS and self.announced == list(range(STEPS + 1))
            assert self.sampled == Counter(range(STEPS)), self.sampled  # every version sampled once
            record = JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, self.job)).value)
            assert record.state is JobState.COMPLETED and record.version == STEPS and len(record.rewards) == STEPS
            spans = [METRIC.decode(m.data) for m in await pending_messages(self.spans_sub)]
            trained = Counter(s.version for s in spans if s.phase == "train")
            # trained once per version, again only after an attempt that was not committed
            assert trained == Counter({v: 1 + self.discarded[v] for v in range(STEPS)}), (trained, self.discarded)
            # ... and always from the committed version's own adapter (the logprob gap needs a real engine)
            assert [p for p in audit_training(spans) if "trained from other versions" in p] == []
            world.seen["runs finished"] += 1

        async def clean_up(self) -> None:
            await cancel_job(world.manager.jobs, encode(api.CancelRequest(job=self.job)))  # if a run failed midway
            for sub, (stream, durable) in zip(self.subs, self.consumers):
                await sub.unsubscribe()  # else its last expired fetch holds the bus's drain at close
                await bus.js.delete_consumer(stream, durable)

    return VersionStateMachine


def test_the_version_state_machine_commits_announces_and_samples_each_version_once(
        nats_server, tmp_path, monkeypatch):
    world = World(nats_server.url, tmp_path)
    monkeypatch.setattr(trainer_service, "maybe_crash", world.maybe_crash)
    started = time.monotonic()
    try:
        run_state_machine_as_test(machine_over(world), settings=EXAMPLES)
    finally:
        world.close()
    print(f"\nwhat {world.seen['runs finished']} runs exercised in {time.monotonic() - started:.0f}s: "
          f"{dict(sorted(world.seen.items()))}")
    # the runs did reach the faults (each kind alone is left to chance: the branch tests in
    # test_trainer_faults.py hit each one deterministically)
    assert world.seen[f"crash: {AFTER_WRITE}"] + world.seen[f"crash: {AFTER_CAS}"] > 0
    assert world.seen["announcement: old"] and world.seen["announcement: repeat"]
    assert world.seen["trainer B after holding: ack"] + world.seen["trainer B after holding: term"] > 0
