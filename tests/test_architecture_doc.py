"""docs/architecture.md's layer picture is what the code's imports draw (scripts/layers.py): it cannot go stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_layer_picture_matches_the_code() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "layers.py"), "--check"], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_check_fails_on_a_stale_picture(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    stale = tmp_path / "architecture.md"
    stale.write_text(f"{layers.START}\n```mermaid\nflowchart TD\n    a --> b\n```\n{layers.END}\n")
    monkeypatch.setattr(layers, "DOC", stale)
    assert layers.main(["--check"]) == 1
    monkeypatch.setattr(layers, "DOC", ROOT / "docs" / "architecture.md")
    assert layers.main(["--check"]) == 0
