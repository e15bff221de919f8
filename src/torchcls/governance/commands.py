"""The governance subcommands: `torchcls data manifest`, `torchcls verify`, `torchcls lineage`, and
`torchcls governance keygen|verify-log|verify-attestation`.

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
                   help="re-read and hash every data file (the default); --no-rehash trusts the hash cache of your "
                   "own runs (--out-dir OUT_DIR: OUT_DIR/_governance/hash_cache.sqlite) for files whose "
                   "size, mtime and inode are unchanged")
    p.add_argument("--out-dir", metavar="OUT_DIR", help="the out dir of your own runs, whose hash cache --no-rehash "
                   "trusts (default: runs, train's; never the cache beside the artifact's audit log, which may have "
                   "come with it)")
    _key_flags(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("lineage", help="which runs and artifacts used a file (for erasure requests)",
                       description="Find every run and artifact built from a data file.")
    p.add_argument("--file", required=True, metavar="PATH_OR_HASH", help="a data file, or its SHA-256")
    p.add_argument("--audit-log", default="runs/_governance/audit.jsonl",
                   help="audit log (default: runs/_governance/audit.jsonl)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_lineage)
    _add_signing_commands(sub)
    return dsub


EXIT_HELP = "exit 0: verified; 3: intact but unverified (no trusted key given: provenance unproven); 1: failed"


def _key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--public-key", action="append", metavar="FILE", help="a trusted public key (PEM, from `torchcls "
                   "governance keygen`), repeatable: every record must be signed by a trusted key (default: the "
                   "files in TORCHCLS_TRUSTED_KEYS, separated by ':')")
    p.add_argument("--audit-key-file", help="the legacy HMAC audit key, to check HMAC-signed records (default: the "
                   "TORCHCLS_AUDIT_KEY environment variable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_signing_commands(sub) -> None:
    g = sub.add_parser("governance", help="signing keys and audit log checks (keygen, verify-log, "
                       "verify-attestation)", description="Key pairs that sign the audit log and exports, and checks "
                       "that need only the public key.")
    gsub = g.add_subparsers(dest="governance_command", required=True, metavar="GOVERNANCE_COMMAND")
    p = gsub.add_parser("keygen", help="write a new signing key pair", description="Write DIR/signing-key.pem "
                        "(the private key, mode 0600: keep it outside runs/, pass it as --signing-key-file or "
                        "TORCHCLS_SIGNING_KEY) and DIR/signing-key.pub.pem (give it to verifiers: --public-key).")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the two key files (never overwritten)")
    p.add_argument("--algorithm", default="ed25519", choices=["ed25519", "ecdsa-p256"],
                   help="ed25519 (default) or ecdsa-p256 (the curve OpenSSF model_signing's key mode and cosign take)")
    p.set_defaults(func=_cmd_keygen)
    p = gsub.add_parser("verify-log", help="check an audit log: every line a record, its chain, its signatures",
                        description=f"Check an audit log on its own. {EXIT_HELP}.")
    p.add_argument("audit_log", metavar="AUDIT_LOG", help="e.g. runs/_governance/audit.jsonl")
    p.add_argument("--policy", help="a policy TOML whose [provenance] trusts key ids or requires signatures")
    _key_flags(p)
    p.set_defaults(func=_cmd_verify_log)
    p = gsub.add_parser("verify-attestation", help="check an export's signed in-toto attestation (no audit log)",
                        description="Check ARTIFACT.intoto.jsonl: signed by a trusted public key and naming "
                        "this file's SHA-256. Exit 0: verified; 1: not.")
    p.add_argument("artifact", metavar="ARTIFACT", help="an exported artifact with its .intoto.jsonl beside it")
    p.add_argument("--public-key", action="append", metavar="FILE", help="a trusted public key (PEM), repeatable "
                   "(default: the files in TORCHCLS_TRUSTED_KEYS)")
    p.set_defaults(func=_cmd_verify_attestation)


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
                 key_file=args.audit_key_file, public_keys=args.public_key, out_dir=args.out_dir)
    return _print_result(res, args.json)


def _print_result(res, as_json: bool) -> int:
    from torchcls.governance.logcheck import EXIT_CODES

    if as_json:
        print(json.dumps(res.to_dict(), indent=2))
        return EXIT_CODES[res.status]
    for c in res.checks:
        print(f"{c.status.upper():4}  {c.name}: {c.detail}")
    if res.status == "unverified":
        print(f"UNVERIFIED: {res.artifact}: {res.unproven}")
    else:
        print(f"{'PASS' if res.ok else 'FAIL'}: {res.artifact}" + (" (verified)" if res.ok else ""))
    return EXIT_CODES[res.status]


def _cmd_verify_log(args: argparse.Namespace) -> int:
    from torchcls.governance.logcheck import verify_log

    return _print_result(verify_log(args.audit_log, args.audit_key_file, args.public_key, args.policy), args.json)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from torchcls.provenance.signing import SIGNING_KEY_ENV, keygen

    private, public, keyid = keygen(args.out, args.algorithm)
    print(f"wrote {private} (private key, mode 0600: keep it secret, outside runs/; use it with --signing-key-file "
          f"or {SIGNING_KEY_ENV})\nwrote {public} (public key: give it to verifiers, --public-key)\nkey id {keyid}")
    return 0


def _cmd_verify_attestation(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torchcls.errors import UserError
    from torchcls.provenance.attestation import attestation_path, verify_attestation
    from torchcls.provenance.digest import sha256_file
    from torchcls.provenance.signing import load_public_key, trusted_key_files

    path = Path(args.artifact)
    if not path.is_file() or not attestation_path(path).is_file():
        raise UserError(f"{path} or its attestation {attestation_path(path).name} is missing (exports signed with "
                        "a key pair write one)")
    ok, detail = verify_attestation(path, sha256_file(path),
                                    dict(load_public_key(f) for f in trusted_key_files(args.public_key)))
    print(f"{'PASS' if ok else 'FAIL' if ok is False else 'UNVERIFIED'}: {path}: {detail}")
    return 0 if ok else 1 if ok is False else 3


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
