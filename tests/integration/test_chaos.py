"""The chaos run (libs/marlaas/bench/chaos.py) at a small size: four jobs of 20 versions, at least
20 SIGKILLs of trainer, rollout, env and manager (the trainer also dies between adapter write and
commit, and between commit and announcement), two nats-server restarts; nothing lost, nothing
repeated, nothing orphaned. The jobs cover each way a batch travels: whole batches (the default),
complete-group pipelining, and bounded staleness 1 (whole batches) and 2 (by groups): sampled
ahead, a trainer killed with groups held. ``python benchmarks/chaos.py`` runs longer ones. With 12 versions a
job, a fast host finished the jobs after only 12 of the 20 kills (kills are paced by progress)."""

from __future__ import annotations

import pytest

from marlaas.bench.chaos import run_chaos

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("the chaos run kills and restarts services and the broker")]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_kills_lose_no_version_repeat_no_batch_and_leave_no_orphan(tmp_path):
    result = run_chaos(jobs=4, steps=20, min_kills=20, nats_restarts=2, seed=1, home=tmp_path / "home",
                       timeout_s=1500, grpo=({"pipeline": "groups"}, {"max_staleness": 1}, {},
                                             {"max_staleness": 2, "pipeline": "groups"}))
    print(result)
    assert result["problems"] == []
    assert result["service_kills"] >= 20 and result["nats_restarts"] == 2
    assert set(result["kills"]) >= {"trainer", "rollout", "env", "manager"}
