"""README quotes the frontend's words as the screen shows them (issue 48 item 5): the menu path and
label of the "show run statistics" command, and the node's right-click item, are read from
web/safesage.js; the panel's note that its counts are totals since ComfyUI started is in both."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JS = (REPO / "web" / "safesage.js").read_text()


def _readme() -> str:
    return re.sub(r"\s+", " ", (REPO / "README.md").read_text())


def _menu():
    """(menu path, command label) of the stats command, as web/safesage.js registers them."""
    cmd = re.search(r'commands: \[\{ id: STATS_CMD, label: ("[^"]+")', JS)
    path = re.search(r'menuCommands: \[\{ path: (\[[^\]]*\]), commands: \[STATS_CMD\]', JS)
    assert cmd and path, "web/safesage.js no longer registers the stats command as this test reads it"
    return json.loads(path.group(1)), json.loads(cmd.group(1))


def test_readme_quotes_the_menu_item_exactly():
    path, label = _menu()
    assert "**%s → \"%s\"**" % (" → ".join(path), label) in _readme(), (path, label)


def test_readme_quotes_the_right_click_item_exactly():
    item = re.search(r'options\?\.push\?\.\(\{ content: ("[^"]+")', JS)
    assert item, "web/safesage.js no longer adds the node's right-click item as this test reads it"
    assert '**%s**' % item.group(1) in _readme()


def test_the_panel_says_its_counts_are_since_comfyui_started():
    assert "Totals since ComfyUI started (not per run)" in JS
    assert "totals since ComfyUI started, not one run's" in _readme()
