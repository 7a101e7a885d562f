"""Text taken from files (tensor names, file names, metadata) made safe to show: :func:`printable`.

A checkpoint chooses its tensor names freely (safetensors allows any JSON
string as a key; a torch file any ``str``), and a folder its file names. Shown
raw, a name can drive the terminal it is printed on (``ESC ] 52`` writes the
clipboard, ``ESC [ 2J`` clears the screen, a carriage return overwrites the
line, U+202E reverses the text after it) or forge a line of output (a newline).
Every text the library and the CLI show to people passes through
:func:`printable`; the exact names stay in the objects (``error.tensor``,
``report.loaded``) and in JSON output.

A URL can carry secrets: the password of its userinfo
(``https://user:PASSWORD@host/``) and the signature of a presigned or SAS
query (``X-Amz-Signature=``, ``X-Amz-Security-Token=``, ``sig=``). Every URL
a user sees is rendered by :func:`shown_url`, which keeps the scheme, host
and path and drops the rest but for the query's parameter names; and
:func:`printable` renders every URL in the text it is given so, whoever
wrote the text (an error's reason, a library's exception, a log record).
"""

from __future__ import annotations

import re

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


_USERINFO_AND_AFTER = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*@)?([^?#]*)(\?[^#]*)?(#.*)?$", re.DOTALL)
# A query parameter's name shown as it is; anything else (a bare token, a name that could be a value) is elided
_PARAMETER_NAME = re.compile(r"[A-Za-z0-9_.~%-]{1,64}")
ELIDED = "\u2026"
# Schemes whose URL names a container before the "@" (az://CONTAINER@ACCOUNT.blob.core.windows.net/key): no secret
CONTAINER_AT_ACCOUNT_SCHEMES = frozenset({"az", "abfs", "abfss", "wasb", "wasbs"})
# How a hint writes where credentials go (HTTPS_PROXY=http://USER:PASSWORD@HOST:PORT): a form, not a secret
PLACEHOLDER_USERINFO = "USER:PASSWORD@"


def shown_url(url: str) -> str:
    """``url`` as every output shows it: without its userinfo (``user:password@``) and fragment, its query
    reduced to its parameter names (``?X-Amz-Credential=\u2026&X-Amz-Signature=\u2026``; a part that is not
    ``name=value`` with a plain name shows as ``\u2026``). A text that is not a URL is returned as it is. Azure's
    ``az://CONTAINER@ACCOUNT...`` keeps its container, which is no credential, and a hint's
    ``http://USER:PASSWORD@HOST:PORT`` its placeholders.

    What is shown still names the object (scheme, host, port, path) and says that the URL was signed, and
    showing it again changes nothing (``shown_url(shown_url(u)) == shown_url(u)``).
    """
    found = _USERINFO_AND_AFTER.match(url)
    if found is None:
        return url
    scheme, userinfo, rest, query, fragment = found.groups()
    if userinfo is not None and (userinfo == PLACEHOLDER_USERINFO or scheme[:-3].lower() in
                                 CONTAINER_AT_ACCOUNT_SCHEMES and ":" not in userinfo):
        rest, userinfo = userinfo + rest, None
    if userinfo is None and query is None and fragment is None:
        return url
    if query is not None:
        items = [item.partition("=") for item in query[1:].split("&") if item]
        query = "?" + "&".join(f"{name}={ELIDED}" if equals and _PARAMETER_NAME.fullmatch(name) else ELIDED
                               for name, equals, _ in items)
    return f"{scheme}{rest}{query or ''}"


# A URL inside a longer text ends at whitespace or a quote; punctuation that ends a sentence or a clause is not
# taken as its last character
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*[^\s'\"<>`.,:;)\]]")


def hide_url_secrets(text: str) -> str:
    """``text`` with every URL in it rendered by :func:`shown_url`."""
    if "://" not in text:  # the common case, at C speed
        return text
    return _URL_IN_TEXT.sub(lambda found: shown_url(found.group()), text)


def printable(text: str) -> str:
    """``text`` with every character Python does not call printable written as its backslash escape.

    The rule, Python's ``str.isprintable``: C0 controls, DEL and C1 controls,
    format characters (the bidirectional overrides U+202A-U+202E, U+2066-U+2069,
    zero-width characters), line and paragraph separators, spaces other than
    U+0020, surrogates (a lone one cannot even be encoded as UTF-8), private-use
    and unassigned code points become ``\\n``, ``\\r``, ``\\t``, ``\\xNN``,
    ``\\uNNNN`` or ``\\UNNNNNNNN``, as ``repr`` writes them. Letters, digits,
    punctuation and symbols of any script (``é``, ``中``) stay as they are, and
    so does the backslash itself: the text stays readable, and a name shown
    escaped is recognizable (JSON output, not this, is the exact form).

    The result has no character outside the printable set, so it holds no
    line break and always encodes to UTF-8. It is at most 4 characters for
    each byte an escaped character takes in UTF-8 (``\\x1b`` for 1 byte,
    ``\\u202e`` for 3; a lone surrogate, which has no UTF-8 form, arrives as
    a 6-byte ``\\ud800`` JSON escape or 3 bytes of a torch file's pickle):
    what it shows of a file is a few times that file's size at most.

    Every URL in ``text`` is shown by :func:`shown_url`: no secret of a URL is printed.
    """
    if "://" in text:
        text = hide_url_secrets(text)
    if text.isprintable():  # the common case, at C speed
        return text
    return _OUTSIDE_ASCII.sub(_escape_run, text)


# Runs of characters other than printable ASCII: only those need a look, one character at a time, and only
# where the run as a whole is not printable (a name in another script is one printable run).
_OUTSIDE_ASCII = re.compile(r"[^ -~]+")


def _escape_run(match: re.Match) -> str:
    run = match.group()
    if run.isprintable():
        return run
    return "".join(char if char.isprintable() else _NAMED.get(char) or repr(char)[1:-1] for char in run)
