"""benchmarks/serve_soak.py, small: 300 requests (a fifth hostile) from 8 clients against a real server process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")  # the 'serve' extra
pytestmark = pytest.mark.slow
SOAK = Path(__file__).parent.parent / "benchmarks" / "serve_soak.py"


def test_soak_answers_every_request_without_5xx(tmp_path):
    out = tmp_path / "soak.json"
    # The 16-bit 8000x8000 PNG (seconds of decoding each) stays out of the small version: --heavy-every 0.
    r = subprocess.run([sys.executable, str(SOAK), "--model", "smallnet", "--img-size", "28", "--requests", "300",
                        "--concurrency", "8", "--heavy-every", "0", "--timeout", "120", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["sent"] == result["answered"] == 300 and result["unsent"] == 0
    assert result["server_errors_5xx"] == 0 and result["lost"] == 0 and result["wrong_status"] == 0
    assert result["hostile_sent"] == 60 and result["server_exit_code"] == 0
    kinds = result["by_kind"]
    for kind, v in kinds.items():  # every kind was sent, and each hostile one was refused with a 4xx
        assert v["sent"] >= 4, kind
        if v["hostile"]:
            assert set(v["statuses"]) <= {"400", "404", "413", "503"}, (kind, v["statuses"])
    assert kinds["body above limit"]["statuses"].get("413") and kinds["unknown model"]["statuses"].get("404")
    assert result["probes_failed"] == 0 and result["rss_after_mb"] > 0
    assert "| 5xx (not 503) | lost | 503 |" in r.stdout and "PASS" in r.stdout
