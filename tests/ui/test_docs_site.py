"""The docs site, built once for the module (`mkdocs build --strict`: broken links, pages missing
from the nav and unknown references fail it): the generated references are in it, and the
architecture page shows its diagram as a picture (issues 36 and 49: the committed
docs/architecture.svg, which tests/unit/test_draw_architecture.py ties to its source), with nothing
fetched from another host, also in a real browser (headless Chromium)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_FILL = (0xEE, 0xF3, 0xFB)  # docs/architecture.dot: the services' boxes
QUEUE_FILL = (0xEE, 0xF7, 0xE8)  # ... and the streams'

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The site, built once for this module's tests (each build takes several seconds of CPU)."""
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    return site, done


@pytest.fixture
def site(built) -> Path:
    path, done = built
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def pixels_near(png: bytes, colour: tuple[int, int, int]) -> int:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for pixel in image.get_flattened_data() if all(abs(a - b) <= 3 for a, b in zip(pixel, colour)))


def test_the_architecture_page_shows_a_drawn_diagram(browser, site, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get((site / "architecture" / "index.html").as_uri())
    picture = browser.find_element(By.CSS_SELECTOR, "img[src$='architecture.svg']")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", picture) > 0
    size = picture.size
    assert size["width"] > 400 and size["height"] > 150, size  # laid out as a picture, not collapsed
    png = picture.screenshot_as_png
    (tmp_path / "architecture.png").write_bytes(png)
    assert pixels_near(png, NODE_FILL) > 2_000 and pixels_near(png, QUEUE_FILL) > 2_000  # boxes filled in


def test_the_site_builds_strictly_with_the_generated_references(built):
    tmp_path, done = built
    assert done.returncode == 0, done.stdout + done.stderr
    config_page = (tmp_path / "configuration" / "index.html").read_text()
    assert "rollout.max_lora_rank" in config_page and "trainer.micro_batch_tokens" in config_page
    assert "reference: config" not in config_page  # the marker was replaced by the table
    job_page = (tmp_path / "using" / "index.html").read_text()
    assert "grpo.learning_rate" in job_page and "eval_every" in job_page
    assert "/v1/jobs/{job}/versions/{version}/pin" in job_page and "Upload a data file" in job_page
    assert "Client.submit(" in job_page and "Client.from_env(" in job_page
    tools_page = (tmp_path / "agentic" / "index.html").read_text()
    assert "serve_async(" in tools_page and "The contract" in tools_page  # the reward's, from its docstring


def test_the_architecture_page_shows_the_committed_svg(site):
    """Issues 36 and 49: the diagram is a picture in the built site (the committed SVG, served beside
    the page, nothing fetched from another host), not diagram source shown as code."""
    page = (site / "architecture" / "index.html").read_text()
    assert 'src="../architecture.svg"' in page
    assert "digraph" not in page and "```" not in page
    svg = (site / "architecture.svg").read_text()
    assert svg == (ROOT / "docs" / "architecture.svg").read_text()
    assert "<script" not in svg and "http://" not in svg.replace("http://www.w3.org/", "")
    assert not (site / "architecture.dot").exists()  # the source stays in the repository
