"""The conformance kit's rules that a contract change added. A plugin written against an older contract fails them
first, so each failure names its rule and the CHANGELOG entry that says what to change (the exact new call)."""

from __future__ import annotations

#: kit rule -> the plugin contract that added it; CHANGELOG.md's "Must change" of that contract names the rule
RULES = {
    "fast_start": 2,
    "video_pixels": 2,
    "shared_parameters": 2,
    "stage_boundaries": 2,
    "bf16_loading": 2,
    "meta_tensors": 4,
}


def since(rule: str) -> str:
    """The suffix of a kit failure of ``rule``: where the migration is written."""
    contract = RULES[rule]
    return (
        f" [kit rule `{rule}`, new in plugin contract {contract}: CHANGELOG.md, 'Contract {contract}', Must change, "
        "says what to change]"
    )
