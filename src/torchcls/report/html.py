"""report.html: the run at a glance, self-contained (images embedded), regenerated from the run dir.

The page is a list of sections (torchcls.report.sections); each renders from the files
it finds in the run dir. Those without data share one closing line that names the command or
flag that would fill each, instead of a heading apiece.
"""

from __future__ import annotations

from pathlib import Path

from torchcls.errors import UserError
from torchcls.report import features, gallery, results  # noqa: F401  (they register their sections)
from torchcls.report.htmlkit import esc
from torchcls.report.sections import ordered
from torchcls.run_files import write_text_atomic

# Nothing may widen the page past the viewport (checked at 1280 px in a headless browser, tests/test_report_browser.py):
# a wide table scrolls inside its own box, and long unbroken words (op names, paths, hashes) wrap.
CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0;display:block;max-width:100%;overflow-x:auto}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;overflow-wrap:anywhere}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
.kpi{display:inline-block;margin:0 1.5em 1em 0}.kpi b{display:block;font-size:1.6em}
pre{background:#f7f7f7;padding:1em;white-space:pre-wrap;overflow-wrap:anywhere}code{overflow-wrap:anywhere}
.notrun{color:#888}.st-pass{color:#070}.st-fail{color:#b00;font-weight:bold}.st-warn{color:#b60}.st-skip{color:#888}
nav a{margin-right:1em}.gallery{display:flex;flex-wrap:wrap;gap:.8em}.gallery figure{margin:0;width:112px;font-size:.8em}
.gallery img{width:96px;height:96px;object-fit:contain;image-rendering:pixelated;background:#000}
.gallery figcaption{overflow-wrap:anywhere}.wrong{color:#b00}"""

# The page runs no script and loads nothing: its figures are data: URLs and its style is inline. Said to the
# browser too, so that a value from a received run dir that reached the page unescaped still could not run
# code, load a resource, send a form or change the page's base (every value is escaped as well: htmlkit.esc).
CSP = ("<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; "
       "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'\">")


def render_sections(run_dir: Path) -> list[tuple[str, str, str | None]]:
    """(key, title, html or None when not run) per section, in page order."""
    out = []
    for s in ordered():
        try:
            body = s.render(run_dir)
        # A record of another shape (another version's, or a received one): said, and the page kept. Only the
        # errors a value of the wrong type or a missing key raises: a bug elsewhere still surfaces.
        except (AttributeError, LookupError, TypeError, ValueError) as e:
            body = f"<p class='notrun'>could not read this section's data: {esc(type(e).__name__)}: {esc(e)}</p>"
        except UserError as e:  # a file refused (a link, a FIFO, too large): named, the rest of the page kept
            body = f"<p class='notrun'>refused: {esc(e)}</p>"
        out.append((s.key, s.title, body))
    return out


def write_report(run_dir: str | Path) -> Path:
    return build_report(run_dir)[0]


def build_report(run_dir: str | Path) -> tuple[Path, list[tuple[str, str, str | None]]]:
    """Write report.html; also return which sections had data."""
    run_dir = Path(run_dir)
    nav, parts = [], [f"<h1>torchcls run: {esc(run_dir.name)}</h1>"]
    how = {s.key: s.how_to_run for s in ordered()}
    rendered = render_sections(run_dir)
    for key, title, body in rendered:
        if body is not None:
            nav.append(f"<a href='#{key}'>{esc(title)}</a>")
            parts.append(f"<section id='{key}'><h2>{esc(title)}</h2>{body}</section>")
    missing = [(key, title) for key, title, body in rendered if body is None]
    if missing:  # one line for every section without data, each with what would fill it
        nav.append("<a href='#not-run'>Not run</a>")
        parts.append("<p id='not-run' class='notrun'>Not run: " + "; ".join(
            f"<span data-section='{key}'>{esc(title)} (<code>{esc(how[key])}</code>)</span>"
            for key, title in missing) + ".</p>")
    parts.insert(1, f"<nav>{''.join(nav)}</nav>")
    out = run_dir / "report.html"
    write_text_atomic(out, f"<!doctype html><html><head><meta charset='utf-8'>{CSP}<title>{esc(run_dir.name)}</title>"
                   f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>")
    return out, rendered
