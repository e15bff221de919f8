"""Provenance: the audit log's format, signatures and attestations, what an artifact carries of its
lineage, and the trust decision before native code is loaded. The core reads and checks these when it
loads or exports an artifact; governance (a consumer) decides what is recorded and when.

Light to import: nothing is loaded until a submodule is imported.
"""
