"""One folder's listing as an object store gives it, page after page: the bounds that end a listing the store
would never end, and the check of every name it lists.

S3 (ListObjectsV2), Google Cloud Storage and Azure Blob Storage list a prefix a page at a time, each page naming
the next by a continuation token (a marker, a page token), and the store alone decides when the listing ends. A
store that answers "more" forever, with the token it gave before or a new one each time, would hold a load in a
loop that never returns, and one listing millions of names would fill memory before anything is loaded. Each
store's paging loop feeds a :class:`ListingPages` every page's names and the token that page gave, and it
refuses, as a :class:`~materialize.errors.CheckpointError` naming the listing:

- a token the listing already followed, at once (the store would answer the same pages again, forever);
- a page past ``RemoteOptions.max_listing_pages``, or a name past ``max_listing_names`` (files and folders,
  all pages together), each saying how to raise the bound.

The names become keys joined to the folder's (``RemotePath.iterdir``), files the readers open and names that
messages show. A name holding NUL or another control character, a ``..`` component or a leading ``/`` (which
would name something outside the folder) is refused where the listing is read, naming the listing: never passed
on to end a load in a raw ``ValueError: embedded null byte`` somewhere below, nor skipped unseen.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

from ..errors import CheckpointError
from .settings import RemoteOptions

SHOWN_CHARACTERS = 200  # of a refused name, in the message: a store may list a name of any length
# Unicode's Cc: the C0 controls, DEL and the C1 controls (a newline, an escape sequence that drives a terminal)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ListingPages:
    """The bookkeeping of one folder's listing: pages and names counted against their bounds, tokens followed,
    each name checked. ``url`` names the listing in errors (``s3://bucket/prefix/``)."""

    def __init__(self, url: str, options: RemoteOptions) -> None:
        self.url = url
        self.max_pages = options.max_listing_pages
        self.max_names = options.max_listing_names
        self.pages = 0
        self.names = 0
        self._followed: set[str] = set()

    def page(self, names: Sequence[str]) -> None:
        """Count one page read and check its names (its files' and folders', relative to the folder) before any
        is used."""
        self.pages += 1
        self.names += len(names)
        if self.names > self.max_names:
            raise CheckpointError(f"the listing holds more than {self.max_names:,} names (files and folders) by its "
                                  f"page {self.pages:,}; a folder this large is read with a higher bound: "
                                  "RemoteOptions(max_listing_names=...)", path=self.url)
        for name in names:
            refused = _refusal(name)
            if refused:
                shown = name[:SHOWN_CHARACTERS] + ("..." if len(name) > SHOWN_CHARACTERS else "")
                raise CheckpointError(f"the store listed the name {shown!r}, which {refused}: refused (a listing "
                                      "names what is inside its folder)", path=self.url)

    def next_token(self, token: Optional[str]) -> Optional[str]:
        """The token to ask the next page with, as the last page gave it; ``None`` where the listing ended (no
        token). A token followed before, or a page past the bound, is refused instead of asked for."""
        if not token:
            return None
        if token in self._followed:
            raise CheckpointError(f"the store repeated its continuation token after {self.pages:,} pages: the "
                                  "listing would never end", path=self.url)
        if self.pages >= self.max_pages:
            raise CheckpointError(f"the listing goes on past {self.max_pages:,} pages (the store still names a "
                                  "next one); a folder this large is read with a higher bound: "
                                  "RemoteOptions(max_listing_pages=...)", path=self.url)
        self._followed.add(token)
        return token


def _refusal(name: str) -> str:
    """Why a listed name cannot be a name inside the folder; ``""`` where it can."""
    if "\0" in name:
        return "holds a NUL character"
    if _CONTROL.search(name):
        return "holds a control character"
    if name.startswith("/"):
        return "is absolute (begins with '/')"
    if ".." in name.split("/"):
        return "has a '..' component"
    return ""
