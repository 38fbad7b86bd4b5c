"""String ``format``s the grammar enforces, as the patterns omlx gives xgrammar; pure.

xgrammar 0.2.8 knows more formats, but some of its regexes admit strings that
validators refuse (``date`` 2021-02-31, ``ipv4`` 01.2.3.4, ``time`` 12:00:60Z,
hostnames with 64-character labels, ``json-pointer`` with raw quotes). Those are
replaced by the stricter patterns below: every string they match is valid, at
the cost of a few valid but rare spellings (leap seconds, very long labels).
"""

from __future__ import annotations

_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d{2}|[1-9]\d{3})"
_MONTH_DAY = (
    r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
    r"|02-(0[1-9]|1\d|2[0-8]))"
)
# February 29th only in leap years: divisible by 4, and by 400 for centuries.
_LEAP_DAY = r"(\d{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29"
_DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d([.]\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_H16 = r"[0-9a-fA-F]{1,4}"
# The hexadecimal spellings of RFC 4291 (no embedded IPv4 tail).
_IPV6 = "|".join(
    (
        rf"({_H16}:){{7}}{_H16}",
        rf"({_H16}:){{1,7}}:",
        rf"({_H16}:){{1,6}}:{_H16}",
        rf"({_H16}:){{1,5}}(:{_H16}){{1,2}}",
        rf"({_H16}:){{1,4}}(:{_H16}){{1,3}}",
        rf"({_H16}:){{1,3}}(:{_H16}){{1,4}}",
        rf"({_H16}:){{1,2}}(:{_H16}){{1,5}}",
        rf"{_H16}:(:{_H16}){{1,6}}",
        rf":((:{_H16}){{1,7}}|:)",
    )
)
# Labels of at most 47 characters without "--" (reserved for IDNA), at most 4 of them.
_LABEL = r"[a-z0-9]{1,15}(-[a-z0-9]{1,15}){0,2}"
_EMAIL_LOCAL = r"[A-Za-z0-9_%+-]{1,32}([.][A-Za-z0-9_%+-]{1,15})?"
_EMAIL_LABEL = r"[A-Za-z0-9]{1,15}(-[A-Za-z0-9]{1,15}){0,2}"

# format -> the pattern enforced instead (xgrammar's own regex is looser).
FORMAT_PATTERNS: dict[str, str] = {
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "ipv6": rf"^({_IPV6})$",
    "hostname": rf"^{_LABEL}(\.{_LABEL}){{0,3}}$",
    "email": rf"^{_EMAIL_LOCAL}@({_EMAIL_LABEL}\.){{1,3}}[A-Za-z]{{2,12}}$",
    # Reference tokens of printable ASCII (xgrammar's "[^/~]" lets invalid UTF-8 through).
    "json-pointer": r"^(/([A-Za-z0-9 _.$@!*+,;=:-]|~[01])*)*$",
}
# Formats xgrammar's own regex enforces exactly enough (checked with validators).
XGRAMMAR_FORMATS = frozenset({"uuid", "uri", "uri-reference", "uri-template", "duration"})
ENFORCED_FORMATS = frozenset(FORMAT_PATTERNS) | XGRAMMAR_FORMATS
# The formats JSON Schema defines. Others ("password", "int64", "phone") assert
# nothing: validators ignore them, so there is nothing to enforce or refuse.
STANDARD_FORMATS = ENFORCED_FORMATS | {
    "idn-email",
    "idn-hostname",
    "iri",
    "iri-reference",
    "relative-json-pointer",
    "regex",
}
# Lengths every value of a format has, to tell whether minLength/maxLength beside
# the format add anything (they cannot be enforced together with it).
FORMAT_LENGTHS: dict[str, tuple[int, int]] = {
    "date": (10, 10),
    "uuid": (36, 36),
    "ipv4": (7, 15),
    "time": (9, 21),
    "date-time": (20, 32),
    "email": (6, 205),
    "hostname": (1, 191),
    "ipv6": (2, 39),
}
