"""DSSE, the Dead Simple Signing Envelope (in-toto's, sigstore's and SLSA's envelope):
https://github.com/secure-systems-lab/dsse/blob/master/envelope.md

    {"payloadType": TYPE, "payload": base64(BODY), "signatures": [{"keyid": KEYID, "sig": base64(SIG)}]}

SIG signs PAE(TYPE, BODY) = "DSSEv1" SP len(TYPE) SP TYPE SP len(BODY) SP BODY (lengths in ASCII decimal):
the type is signed with the body, so a signature over one kind of payload can never be replayed as
another, and the body is signed as bytes, with no JSON canonicalisation to get wrong.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

RECORD_TYPE = "application/vnd.torchcls.audit-record+json"
INTOTO_TYPE = "application/vnd.in-toto+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a signature actually signs."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


@dataclass(frozen=True)
class Envelope:
    payload_type: str
    payload: bytes
    signatures: tuple[tuple[str, bytes], ...]  # (keyid, signature)

    def to_json(self) -> dict[str, Any]:
        return {"payloadType": self.payload_type, "payload": _b64(self.payload),
                "signatures": [{"keyid": k, "sig": _b64(s)} for k, s in self.signatures]}

    def signed_bytes(self) -> bytes:
        return pae(self.payload_type, self.payload)


def sign(payload_type: str, payload: bytes, signer) -> Envelope:
    """`signer`: a signing.Signer."""
    return Envelope(payload_type, payload, ((signer.keyid, signer.sign(pae(payload_type, payload))),))


def is_envelope(obj: Any) -> bool:
    return isinstance(obj, dict) and "payloadType" in obj and "payload" in obj


def parse(obj: Any) -> Envelope:
    """An envelope from its JSON form; ValueError naming what is malformed. Strict: exactly the three
    fields, base64 that decodes, at least one signature, each with a keyid and a sig."""
    if not isinstance(obj, dict) or set(obj) != {"payloadType", "payload", "signatures"}:
        raise ValueError("not a DSSE envelope (payloadType, payload, signatures)")
    ptype, payload, sigs = obj["payloadType"], obj["payload"], obj["signatures"]
    if not isinstance(ptype, str) or not isinstance(payload, str):
        raise ValueError("DSSE payloadType and payload must be strings")
    if not isinstance(sigs, list) or not sigs:
        raise ValueError("a DSSE envelope without signatures")
    out = []
    for s in sigs:
        if not isinstance(s, dict) or not isinstance(s.get("keyid"), str) or not isinstance(s.get("sig"), str) \
                or set(s) - {"keyid", "sig"}:
            raise ValueError("a DSSE signature must be {keyid, sig} strings")
        out.append((s["keyid"], _unb64(s["sig"])))
    return Envelope(ptype, _unb64(payload), tuple(out))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    """Standard base64 (URL-safe accepted too, as DSSE allows); anything else is malformed."""
    try:
        return base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("DSSE field is not base64") from None
