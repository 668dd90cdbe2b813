"""The architecture picture (scripts/draw-architecture.py): the committed docs/architecture.svg is
drawn from today's docs/architecture.dot, names every service of the page's table, and is what the
page and the README show; the page's first line counts the services it lists (issue 49)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
SVG_TEXT = "{http://www.w3.org/2000/svg}text"
NUMBERS = {4: "Four", 5: "Five", 6: "Six", 7: "Seven", 8: "Eight", 9: "Nine"}


def load_script():
    spec = importlib.util.spec_from_file_location("draw_architecture", ROOT / "scripts" / "draw-architecture.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def table_services() -> list[str]:
    """The first column of the page's service table (rows whose code column is `services/...`)."""
    return re.findall(r"^\| (\w+) \|.*\| `services/\w+` \|$", PAGE.read_text(), re.M)


def test_the_committed_picture_is_drawn_from_todays_source():
    script = load_script()
    recorded = script.recorded_sha256(script.PICTURE.read_text())
    assert recorded is not None, f"{script.PICTURE} has no source stamp: run scripts/draw-architecture.py"
    assert recorded == script.source_sha256(script.SOURCE.read_bytes()), (
        "docs/architecture.dot changed since docs/architecture.svg was drawn: run scripts/draw-architecture.py")


def test_the_picture_is_svg_naming_every_service_of_the_page():
    root = ElementTree.parse(ROOT / "docs" / "architecture.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    labels = {text.text for text in root.iter(SVG_TEXT)}
    services = table_services()
    assert services, "docs/architecture.md lists no service rows"
    assert set(services) | {"NATS JetStream"} <= labels, sorted(labels)
    assert "<script" not in (ROOT / "docs" / "architecture.svg").read_text()  # a picture, nothing that runs


def test_the_page_and_the_readme_show_the_picture():
    page = PAGE.read_text()
    assert "](architecture.svg)" in page and "```dot" not in page
    assert "](docs/architecture.svg)" in (ROOT / "README.md").read_text()


def test_the_pages_first_line_counts_the_services_of_its_table():
    first = PAGE.read_text().split("\n\n")[1]
    count = len(table_services())
    assert first.startswith(f"{NUMBERS[count]} services "), f"the table lists {count} services: {first[:40]!r}"
