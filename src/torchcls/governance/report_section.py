"""The "Data governance" section of report.html, from the run's governance.json."""

from __future__ import annotations

import html
import os
from pathlib import Path

from torchcls import run_files
from torchcls.bounded_json import load_bounded
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.training.rundir import RUN_RECORD


def governance_html(run_dir: Path) -> str:
    f = run_dir / "governance.json"
    if not os.path.lexists(f):
        return ""
    s = load_bounded(run_files.read_bytes(f, max_bytes=SMALL_JSON_BYTES, what="governance.json"), RUN_RECORD, str(f))
    m = s.get("manifest") or {}
    pol = s.get("policy")
    rows = [("lineage id", s.get("lineage_id")),
            ("policy", f"{pol['name']} (sha256 {pol['sha256'][:16]}…)" if pol else "none"),
            ("host region", s.get("region") or "not configured"),
            ("hooks", ", ".join(s.get("hooks") or []) or "none"),
            ("isolated processing path", "yes" if s.get("isolated_processing") else "no"),
            ("data", f"{m.get('name')} — {m.get('records')} records, Merkle root {str(m.get('merkle_root'))[:16]}…"),
            ("license / jurisdiction", f"{m.get('license') or 'not given'} / {m.get('jurisdiction') or 'not given'}"),
            ("sensitivity tags", ", ".join(m.get("tags") or []) or "none"),
            ("sample images", _samples(s.get("samples"))),
            ("file names redacted", s.get("redacted_file_names", 0))]
    if s.get("hash_cache"):
        c = s["hash_cache"]
        rows.append(("data files hashed", f"{c['misses']} read, {c['hits']} unchanged since hashed (hash cache)"))
    if s.get("audit_record"):
        a = s["audit_record"]
        rows.append(("audit record", f"seq {a['seq']}, hash {a['hash'][:16]}…"))
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<h2>Data governance</h2><table>{body}</table>"


def _samples(samples) -> str:
    """governance.json's samples: a sentence ('not requested', 'withheld: ...') or the grid's counts."""
    if isinstance(samples, dict):
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in samples.items()) or "none"
    return str(samples) if samples else "not requested"
