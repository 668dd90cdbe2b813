"""The docs site in a real browser (headless Chromium): the architecture page shows its diagram as
a picture (issue 36), drawn at the build, with nothing fetched from another host."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_FILL = (0xEE, 0xF3, 0xFB)  # docs/architecture.md: the services' boxes
QUEUE_FILL = (0xEE, 0xF7, 0xE8)  # ... and the streams'

pytestmark = pytest.mark.timeout(240)


def pixels_near(png: bytes, colour: tuple[int, int, int]) -> int:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for pixel in image.get_flattened_data() if all(abs(a - b) <= 3 for a, b in zip(pixel, colour)))


def test_the_architecture_page_shows_a_drawn_diagram(browser, tmp_path):
    from selenium.webdriver.common.by import By

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    browser.get((site / "architecture" / "index.html").as_uri())
    diagram = browser.find_element(By.CSS_SELECTOR, "div.diagram svg")
    size = diagram.size
    assert size["width"] > 400 and size["height"] > 150, size  # laid out as a picture, not collapsed
    labels = browser.execute_script(
        "return [...document.querySelectorAll('div.diagram svg text')].map((t) => t.textContent)")
    assert {"gateway", "manager", "POLICY", "NATS JetStream"} <= set(labels), labels
    png = diagram.screenshot_as_png
    (tmp_path / "architecture.png").write_bytes(png)
    assert pixels_near(png, NODE_FILL) > 2_000 and pixels_near(png, QUEUE_FILL) > 2_000  # boxes filled in
