"""The dashboard at /ui/, in a real browser: headless Chromium (Debian's, driven by selenium with
Debian's chromedriver) against the session's stack. A wrong token is refused; alice sees her job and not
bob's; her job's reward curve is drawn (checked in the DOM and in a screenshot's pixels); her job's
samples are in a table, and read over HTTP and with `marlaas samples`, while bob gets a missing job's 404."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.tenants import add_tenant
from marlaas.sdk.http import Client, NotFound

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack, pytest.mark.timeout(400)]
JOB = {"task": "reverse", "steps": 3, "seed": 1, "grpo": {"prompts_per_step": 4, "group_size": 4}}
CURVE_BLUE = (31, 95, 191)  # app.css: svg.chart polyline's stroke


@pytest.fixture(scope="module")
def site(shared_stack):
    """On the session's stack, alice's finished job and bob's, each its own tenant (``ui-alice`` and
    ``ui-bob``): (gateway URL, tokens by first name, alice's job, bob's job)."""
    stack = shared_stack

    async def tenants():
        bus = await Bus.connect(stack.nats_url, name="test-ui")
        try:
            return {name: (await add_tenant(bus, f"ui-{name}"))[1] for name in ("alice", "bob")}
        finally:
            await bus.close()

    tokens = asyncio.run(tenants())
    url = (stack.run_dir / "gateway.url").read_text().strip()
    with Client(url, tokens["alice"]) as alice, Client(url, tokens["bob"]) as bob:
        mine, theirs = alice.submit({**JOB, "name": "mine"}), bob.submit({**JOB, "name": "theirs"})
        deadline = time.monotonic() + 240
        while alice.job(mine).state != "completed":
            assert time.monotonic() < deadline, alice.job(mine)
            time.sleep(0.5)
    return url, tokens, mine, theirs


def sign_in(driver, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/ui/")
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#signin button").click()


def until(driver, check, what: str, timeout_s: float = 20):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s).until(lambda d: check(d), message=what)


def drawn(driver, selector: str) -> list[dict]:
    """The chart elements matching ``selector``, read in one script: the charts are redrawn
    every few seconds, so elements fetched one call earlier may already be gone."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => ({class: e.getAttribute('class') || '', "
        "points: e.getAttribute('points') || '', title: e.textContent}))", selector)


def blue_pixels(png: bytes) -> int:
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for pixel in image.get_flattened_data() if all(abs(a - b) < 40 for a, b in zip(pixel, CURVE_BLUE)))


def test_a_wrong_token_is_refused(site, browser, tmp_path):
    from selenium.webdriver.common.by import By

    url, tokens, _, _ = site
    sign_in(browser, url, tokens["alice"][:-4] + "0000")
    error = until(browser, lambda d: d.find_element(By.ID, "signin-error").text, "no sign-in error shown")
    assert "not accepted" in error
    assert not browser.find_element(By.ID, "app").is_displayed()
    (tmp_path / "refused.png").write_bytes(browser.get_screenshot_as_png())


def test_alice_sees_her_job_and_its_curve_and_not_bobs(site, browser, tmp_path):
    from selenium.webdriver.common.by import By

    url, tokens, mine, theirs = site
    sign_in(browser, url, tokens["alice"])
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{mine}"]'), "alice's job listed")[0]
    assert "completed" in row.text and "3 / 3" in row.text
    used = until(browser, lambda d: [r.text for r in d.find_elements(By.CSS_SELECTOR, "#usage tbody tr")
                                     if r.text.startswith(mine)], "no usage row for alice's job")
    assert used and used[0].split()[1] != "0"  # tokens generated
    assert theirs not in browser.page_source  # bob's job is nowhere on alice's page
    row.click()
    (curve,) = until(browser, lambda d: drawn(d, "#chart-reward polyline"), "no reward curve")
    assert len(curve["points"].split()) == 3  # rewards of versions 0, 1 and 2
    bars = until(browser, lambda d: drawn(d, "#chart-timeline rect"), "no seconds per version")
    assert len(bars) == 3  # the seconds between consecutive commits of versions 0..3
    phases = until(browser, lambda d: drawn(d, "#chart-phases rect"), "no timeline drawn")
    for phase in ("generate", "reward", "train", "commit"):  # three versions, each phase of each
        assert sum(r["class"] == f"phase-{phase}" for r in phases) == 3, phases
    assert any(r["title"].startswith("v2 train (trainer)") for r in phases), phases
    assert not browser.find_element(By.ID, "signin").is_displayed()  # signed in: the form is gone
    assert "not an agentic job" in browser.find_element(By.ID, "chart-tools").text
    png = browser.get_screenshot_as_png()
    (tmp_path / "dashboard.png").write_bytes(png)
    assert blue_pixels(png) > 100, "the curve is in the DOM but was not drawn"


def marlaas(url: str, token: str, *args: str) -> subprocess.CompletedProcess:
    """``marlaas ARGS`` as a tenant of the stack at ``url``."""
    env = {**os.environ, "MARLAAS_URL": url, "MARLAAS_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "marlaas.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_alice_reads_her_samples_over_http_and_the_cli_and_bob_gets_a_missing_jobs_404(site):
    url, tokens, mine, _ = site
    with Client(url, tokens["alice"]) as alice:
        info, newest, first = alice.job(mine), alice.samples(mine), alice.samples(mine, version=0)
    assert (newest.versions, newest.version, first.version) == ([0, 1, 2], 2, 0)  # the batches of 3 steps
    for samples in (newest, first):
        assert samples.job == mine and samples.policy_version == samples.version  # strictly on-policy
        assert len(samples.groups) == samples.batch_groups == 4  # prompts_per_step 4 x group_size 4
        for group in samples.groups:
            rewards = [e.reward for e in group.episodes]
            assert group.prompt and group.size == len(group.episodes) == 4
            assert group.reward_mean == pytest.approx(sum(rewards) / 4)
            assert sum(e.advantage for e in group.episodes) == pytest.approx(0.0, abs=1e-3)
            assert all(e.tokens > 0 and not e.turns for e in group.episodes)  # reverse: one turn, the answer
        every = [e.reward for g in samples.groups for e in g.episodes]
        assert sum(every) / len(every) == pytest.approx(info.rewards[samples.version], abs=1e-4)  # what trained

    shown = marlaas(url, tokens["alice"], "samples", mine, "--version", "1", "--json")
    assert shown.returncode == 0, shown.stderr
    as_json = json.loads(shown.stdout)
    assert as_json["version"] == 1 and len(as_json["groups"]) == 4
    text = marlaas(url, tokens["alice"], "samples", mine, "--version", "1")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"{mine} version 1: 4 groups, 16 episodes\n")
    for group in as_json["groups"]:
        assert f"group {group['group']}: 4 episodes" in text.stdout
        assert group["prompt"].splitlines()[0] in text.stdout
    assert text.stdout.count("  episode ") == 16 and text.stdout.count("    answer  | ") == 16

    missing = f"{mine.split('.')[0]}.nothing-000000"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens['bob']}"}) as raw:
        theirs, absent = raw.get(f"/v1/jobs/{mine}/samples"), raw.get(f"/v1/jobs/{missing}/samples?version=1")
    assert theirs.status_code == absent.status_code == 404, theirs.text
    assert theirs.text.replace(mine, "JOB") == absent.text.replace(missing, "JOB")  # indistinguishable
    with Client(url, tokens["bob"]) as bob, pytest.raises(NotFound, match="no job"):
        bob.samples(mine, version=1)
    refused = marlaas(url, tokens["bob"], "samples", mine)
    assert refused.returncode == 2 and "no job" in refused.stderr and not refused.stdout


def samples_table(driver) -> dict:
    """The samples table's note, version choices and rows (cell texts), read in one script."""
    return driver.execute_script(
        "return {note: document.querySelector('#samples-note').textContent, "
        "versions: [...document.querySelectorAll('#samples-version option')].map((o) => o.value), "
        "rows: [...document.querySelectorAll('#samples tbody tr')].map((r) => [...r.cells].map((c) => c.textContent))}")


def test_alice_reads_a_versions_samples_on_the_dashboard(site, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, tokens, mine, _ = site
    sign_in(browser, url, tokens["alice"])
    row = until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-job="{mine}"]'), "alice's job listed")
    row[0].click()
    table = until(browser, lambda d: (t := samples_table(d))["rows"] and t, "no samples shown")
    assert table["note"].startswith("version 2: 4 of 4 groups, 16 episodes kept"), table["note"]
    assert table["versions"] == ["", "0", "1", "2"]  # the newest, then each version with samples
    assert len(table["rows"]) == 16 and [r[0] for r in table["rows"]] == [str(g) for g in range(4) for _ in range(4)]
    group, episode, reward, advantage, prompt, turns, answer = table["rows"][0]
    assert episode == "1 of 4" and 0 <= float(reward) <= 1 and advantage[0] in "+-" and prompt and not turns
    with Client(url, tokens["alice"]) as alice:
        assert answer == alice.samples(mine, version=2).groups[0].episodes[0].completion
    Select(browser.find_element(By.ID, "samples-version")).select_by_value("0")
    table = until(browser, lambda d: (t := samples_table(d))["note"].startswith("version 0") and t,
                  "version 0 not shown")
    assert len(table["rows"]) == 16
    (tmp_path / "samples.png").write_bytes(browser.get_screenshot_as_png())
