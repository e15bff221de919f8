"""The governance subcommands: `torchcls data manifest`, `torchcls verify`, `torchcls lineage`.

Kept here so cli.py gains one line; imports stay light until a command runs.
"""

from __future__ import annotations

import argparse
import json


def add_governance_commands(sub):
    """Add the governance commands; returns the `data` sub-parsers so other data tools can join them."""
    p = sub.add_parser("data", help="data set tools: manifest, shard", description="Data set tools.")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    m = dsub.add_parser("manifest", help="hash a data set into a manifest (Croissant/RAI/DPV fields)",
                        description="Write a manifest: every file's SHA-256, size and label (every sample's hash "
                        "for built-in sets), a Merkle root, and the metadata a policy checks.")
    m.add_argument("data", metavar="DATA_DIR_OR_NAME", help="built-in set (mnist-5k, fashion-mnist), ImageFolder "
                   "directory, or CSV (path,label[,tags][,jurisdiction])")
    m.add_argument("--out", help="manifest file (default: ./<name>.manifest.json)")
    m.add_argument("--root", help="fashion-mnist directory, or base of a CSV's relative paths")
    m.add_argument("--name", help="data set name")
    m.add_argument("--description")
    m.add_argument("--license", help="SPDX id, e.g. CC-BY-4.0, MIT, proprietary")
    m.add_argument("--source", dest="url", help="where the data comes from (URL or text)")
    m.add_argument("--jurisdiction", help="jurisdiction of the data, e.g. EU, US, DE")
    m.add_argument("--legal-basis", help="GDPR Art. 6 basis: consent, contract, legal-obligation, vital-interest, "
                   "public-task, legitimate-interest, none")
    m.add_argument("--expires", metavar="YYYY-MM-DD", help="retention date: the data must not be used after it")
    m.add_argument("--tag", action="append", default=[], help="sensitivity tag (repeatable): public, internal, "
                   "confidential, personal, special-category, biometric, faces, health, geolocation, minors")
    m.add_argument("--collection", dest="data_collection", help="how and from whom the data was collected")
    m.set_defaults(func=_cmd_manifest)

    p = sub.add_parser("verify", help="verify an artifact: its hash, lineage, data and policy (exit 1 on failure)",
                       description="Re-hash the artifact, check the audit log's hash chain, walk back to the "
                       "run's data manifests, re-hash the data files when present, check the policy.")
    p.add_argument("artifact", help="a checkpoint or exported artifact")
    p.add_argument("--policy", help="check against this policy TOML (default: the policy recorded for the run)")
    p.add_argument("--audit-log", help="audit log (default: from the artifact's lineage, or OUT_DIR/_governance)")
    p.add_argument("--rehash", action=argparse.BooleanOptionalAction, default=True,
                   help="re-read and hash every data file (the default); --no-rehash trusts the hash cache "
                   "(OUT_DIR/_governance/hash_cache.sqlite) for files whose size, mtime and inode are unchanged")
    p.add_argument("--audit-key-file", help="the audit key, to check every record's signature (default: the "
                   "TORCHCLS_AUDIT_KEY environment variable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("lineage", help="which runs and artifacts used a file (for erasure requests)",
                       description="Find every run and artifact built from a data file.")
    p.add_argument("--file", required=True, metavar="PATH_OR_HASH", help="a data file, or its SHA-256")
    p.add_argument("--audit-log", default="runs/_governance/audit.jsonl",
                   help="audit log (default: runs/_governance/audit.jsonl)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_lineage)
    return dsub


def _cmd_manifest(args: argparse.Namespace) -> int:
    from torchcls.governance.cli_api import write_manifest
    from torchcls.governance.manifest import DatasetMeta

    meta = DatasetMeta(args.name, args.description, args.license, args.url, args.jurisdiction, args.legal_basis,
                       args.expires, args.tag, args.data_collection)
    path, m = write_manifest(args.data, args.out, args.root, meta)
    print(f"wrote {path}: {m['tc:recordCount']} records, Merkle root {m['tc:merkleRoot']}\n"
          f"license {m['license']}, jurisdiction {m['dpv:hasJurisdiction']}, "
          f"tags {', '.join(m['rai:personalSensitiveInformation']) or 'none'}, expires {m['expires']}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from torchcls.governance.verification import verify

    res = verify(args.artifact, policy=args.policy, audit_log=args.audit_log, rehash=args.rehash,
                 key_file=args.audit_key_file)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        for c in res.checks:
            print(f"{c.status.upper():4}  {c.name}: {c.detail}")
        print(f"{'PASS' if res.ok else 'FAIL'}: {args.artifact}")
    return 0 if res.ok else 1


def _cmd_lineage(args: argparse.Namespace) -> int:
    from torchcls.governance.query import file_lineage

    r = file_lineage(args.file, args.audit_log)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"file sha256 {r['sha256']}: in {len(r['manifests'])} manifest(s), used by {len(r['runs'])} run(s)")
    for problem in r["audit_log_problems"]:
        print(f"WARNING {problem}")
    for run in r["runs"]:
        print(f"  run {run['run_id']}  {run['time']}  {run['run_dir']}")
    for a in r["artifacts"]:
        print(f"  artifact {a['path']}  ({a.get('artifact_kind')}, sha256 {a['sha256'][:16]}…, run {a['run_id']})")
    return 0
