"""Where checkpoint bytes come from, below every reader: local files, or objects behind a URL.

A local file is read by :mod:`.fileio` (positional reads straight into
tensor memory, one descriptor per file), its scattered small reads asked of
the kernel ahead by :mod:`.readahead`. A URL becomes a :class:`~.remotepath.RemotePath` over a store (one per
scheme: ``http(s)://`` in :mod:`.httpstore`, ``s3://`` in :mod:`.s3`,
``gs://`` in :mod:`.gcs`, ``az://`` in :mod:`.azure`, the hub's files
through an ``HttpStore`` made in :mod:`materialize.integrations.hub`), and
the readers read it as a local path; the bytes of tensors go through
:class:`~.http.Transport` straight into their destinations. A new kind of storage is a new store registered in
:data:`SCHEMES`, and nothing above this package changes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

from ..errors import CheckpointError
from .remotepath import RemotePath
from .settings import RemoteOptions

__all__ = ["RemoteOptions", "RemotePath", "as_source", "is_url", "open_url"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(source: object) -> bool:
    """Whether ``source`` is a string naming a URL (``scheme://...``) rather than a local path."""
    return isinstance(source, str) and _URL.match(source) is not None


def _open_http(url: str, options: RemoteOptions) -> RemotePath:
    from .httpstore import open_http

    return open_http(url, options)


def _open_s3(url: str, options: RemoteOptions) -> RemotePath:
    from .s3 import open_s3  # botocore: the optional remote extra

    return open_s3(url, options)


def _open_gcs(url: str, options: RemoteOptions) -> RemotePath:
    from .gcs import open_gcs  # google-auth, for credentials: the optional remote extra

    return open_gcs(url, options)


def _open_azure(url: str, options: RemoteOptions) -> RemotePath:
    from .azure import open_azure  # azure-identity, for credentials where no SAS token is given: the remote extra

    return open_azure(url, options)


SCHEMES: dict[str, Callable[[str, RemoteOptions], RemotePath]] = {
    "http": _open_http,
    "https": _open_http,
    "s3": _open_s3,
    "gs": _open_gcs,
    "az": _open_azure,
    "abfs": _open_azure,  # adlfs's names for the same store, with the account in the URL as Spark writes it
    "abfss": _open_azure,
}
_NOT_HERE = {
    "gcs": "Google Cloud Storage: write gs://BUCKET/key",
    "wasbs": "Azure Blob Storage: write az://CONTAINER@ACCOUNT.blob.core.windows.net/key",
    "wasb": "Azure Blob Storage: write az://CONTAINER@ACCOUNT.blob.core.windows.net/key",
    "hf": "the hub: pass the repo id (org/name) with --stream (stream=True)",
}


def open_url(url: str, options: Optional[RemoteOptions] = None) -> RemotePath:
    """The object or folder a URL names, its store made with ``options`` (defaults: :class:`RemoteOptions`)."""
    scheme = _URL.match(url)[1].lower()
    opener = SCHEMES.get(scheme)
    if opener is None:
        hint = _NOT_HERE.get(scheme)
        raise CheckpointError(f"{scheme}:// sources are not read by this build" + (f"; for {hint}" if hint else
                              f" (it reads {', '.join(s + '://' for s in SCHEMES)})"), path=url)
    return opener(url, options or RemoteOptions())


def as_source(path: Union[str, os.PathLike, RemotePath], options: Optional[RemoteOptions] = None
              ) -> Union[Path, RemotePath]:
    """A remote path as it is, a URL opened (:func:`open_url`), anything else a local ``Path``."""
    if isinstance(path, RemotePath):
        return path
    if is_url(path):
        return open_url(path, options)
    return Path(path)
