"""README's support table is generated from the manifests, never typed."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_support_table_is_generated_from_manifests():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "support_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_support_table_lists_every_shipped_manifest():
    sys.path.insert(0, str(REPO / "scripts"))
    import support_table  # noqa: PLC0415

    table = support_table.render(REPO / "patches")
    for manifest in (REPO / "patches").glob("*/*/manifest.json"):
        assert f"| {manifest.parent.name} | {manifest.parent.parent.name} |" in table
