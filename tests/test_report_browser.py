"""report.html in a real browser (headless Chromium, Debian's `chromium`; `make test` installs it as root):
at a 1280 px viewport nothing widens the page, with the widest results a run can hold (the real kernel
audit of torchvision's 28 ops, the gallery, every table)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
VIEWPORT = (1280, 900)
# The flags of a browser that touches nothing beyond the page: this machine's network is closed, and
# without them Chromium tries (and fails) to reach Google's hosts at every start.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "--hide-scrollbars"]
# Written into the page's own DOM once it is laid out, so that --dump-dom returns the measurement.
MEASURE = ("<script>window.addEventListener('load', () => {const d = document.documentElement;"
           "document.body.dataset.measured = JSON.stringify({scroll: d.scrollWidth, viewport: innerWidth, "
           "widest: [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > "
           "innerWidth).slice(0, 5).map(e => e.tagName + ' ' + (e.textContent || '').slice(0, 60))});});</script>")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it as root)")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh profile per start
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def full_report(trained_run, tmp_path_factory) -> Path:
    """The trained run, evaluated, with a real kernel audit of torchvision's ops (the table that overflowed)."""
    from torchcls.evaluation import evaluate
    from torchcls.kernel_audit.kernels import audit_kernels, write_audit
    from torchcls.report import write_report

    run = tmp_path_factory.mktemp("browser") / "run"
    shutil.copytree(trained_run, run)
    evaluate(run, workers=0)
    write_audit(audit_kernels(model=str(run), namespaces=["torchvision", "image"]), run)
    return write_report(run)


def test_report_fits_a_1280_px_viewport(full_report, tmp_path):
    from torchcls.report.html import CSP

    html = full_report.read_text()
    assert "image::decode_jpegs_cuda" in html and "What to fix" in html  # the wide content is there
    probe = full_report.with_name("measured.html")
    probe.write_text(html.replace("</body>", MEASURE + "</body>"))  # the page's own policy: the script never runs
    assert 'data-measured="' not in chromium(tmp_path, "--dump-dom", probe.as_uri()).stdout
    probe.write_text(html.replace(CSP, "").replace("</body>", MEASURE + "</body>"))  # measured without it
    r = chromium(tmp_path, "--dump-dom", probe.as_uri())
    found = re.search(r'data-measured="([^"]+)"', r.stdout)
    assert found, f"no measurement in the DOM:\n{r.stderr[-2000:]}"
    measured = json.loads(found.group(1).replace("&quot;", '"'))
    assert measured["viewport"] == VIEWPORT[0]
    assert measured["scroll"] <= measured["viewport"], f"the page is wider than the viewport: {measured}"


def test_report_screenshot_is_the_viewports_width(full_report, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    r = chromium(tmp_path, f"--screenshot={shot}", full_report.as_uri())
    assert shot.is_file(), r.stderr[-2000:]
    image = Image.open(shot)
    assert image.size == VIEWPORT
    darkest, lightest = image.convert("L").getextrema()
    assert lightest - darkest > 100  # the page rendered: text and figures on white, not a blank frame
