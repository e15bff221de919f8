"""The words manifests and policies may use: sensitivity tags, legal bases, field names.

Field names follow existing vocabularies instead of inventing new ones:
Croissant (schema.org `name`, `license`, `url`, `expires`, `distribution` of `cr:FileObject`
with `sha256` / `contentSize`), Croissant-RAI (`rai:personalSensitiveInformation`,
`rai:dataCollection`) and the W3C Data Privacy Vocabulary (`dpv:hasJurisdiction`,
`dpv:hasLegalBasis`). Only what none of them covers is in the `tc:` (torchcls) namespace.
"""

from __future__ import annotations

from torchcls.errors import UserError

CONTEXT = {
    "@vocab": "https://schema.org/",
    "sc": "https://schema.org/",
    "cr": "http://mlcommons.org/croissant/",
    "rai": "http://mlcommons.org/croissant/RAI/",
    "dpv": "https://w3id.org/dpv#",
    "tc": "https://github.com/torchcls/torchcls/governance#",
}
CONFORMS_TO = ["http://mlcommons.org/croissant/1.0", "http://mlcommons.org/croissant/RAI/1.0"]

# Sensitivity tags (values of rai:personalSensitiveInformation). A closed list: a typo in a
# tag must not silently turn off the hooks a policy requires for the real tag.
TAGS = {
    "public": "published openly, no restrictions beyond the license",
    "internal": "organisation-internal, not personal",
    "confidential": "business-confidential, not personal",
    "personal": "personal data (GDPR Art. 4(1))",
    "special-category": "special categories of personal data (GDPR Art. 9)",
    "biometric": "biometric data, e.g. faces used for identification",
    "faces": "images show people's faces",
    "health": "health or medical data",
    "geolocation": "location data, e.g. GPS in EXIF",
    "minors": "data about children",
}
# Tags whose samples are "restricted": kept out of reports and logs unless a policy says otherwise.
RESTRICTED_BY_DEFAULT = ("personal", "special-category", "biometric", "faces", "health", "geolocation", "minors")

# GDPR Art. 6(1) lawful bases, as DPV terms; "none" = not personal data, no basis needed.
LEGAL_BASES = {
    "consent": "dpv:Consent",
    "contract": "dpv:Contract",
    "legal-obligation": "dpv:LegalObligation",
    "vital-interest": "dpv:VitalInterest",
    "public-task": "dpv:PublicTask",
    "legitimate-interest": "dpv:LegitimateInterest",
    "none": "none",
}


def check_tags(tags: list[str], where: str) -> list[str]:
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise UserError(f"{where}: unknown sensitivity tag(s) {', '.join(map(repr, unknown))}; "
                        f"known tags: {', '.join(TAGS)}")
    return list(tags)


def legal_basis_term(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    if value in LEGAL_BASES.values():
        return value
    if value not in LEGAL_BASES:
        raise UserError(f"{where}: unknown legal basis {value!r}; use one of {', '.join(LEGAL_BASES)}")
    return LEGAL_BASES[value]
