"""How remote sources are read: the options a user sets, and where each is defaulted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

MiB = 1024 * 1024


@dataclass(frozen=True)
class RemoteOptions:
    """How a checkpoint named by a URL (``s3://``, ``gs://``, ``az://``, ``https://``) or streamed from the hub is read.

    Pass as ``remote=`` to :func:`~materialize.load`, :func:`~materialize.load_model`,
    :func:`~materialize.load_tensors`, :func:`~materialize.plan`,
    :func:`~materialize.inspect` or :func:`~materialize.open_checkpoint` (CLI:
    ``--connections``, ``--request-timeout``, ``--retries``, ``--no-sign-request``).
    The defaults suit a cloud object store from a machine in its region and
    a hub download; see docs/remote.md.

    Fields:
        connections: requests in flight at once, each on its own kept-alive connection (at most this many
            connections are open to a host).
        part_bytes: a tensor larger than this is read as parallel ranged GETs of this size.
        timeout: seconds a connection may wait for the server (to connect, or for the next bytes of an answer)
            before the request is retried; also the most an answer's status line and headers may take, all told.
        min_rate: bytes a second an answer's body must average once it has run ``timeout`` seconds; a request
            that falls behind is cut off and retried (a server sending a byte a second cannot hold a load).
        retries: attempts after the first, per part, on a reset connection, a timeout, a 5xx or a SlowDown
            answer, with exponential backoff; a part resumes at the byte where its answer stopped.
        anonymous: read S3, Google Cloud Storage and Azure Blob Storage without credentials (a public bucket or
            container); the CLI's ``--no-sign-request``.
        ca_bundle: a PEM file of certificate authorities for HTTPS (else ``AWS_CA_BUNDLE`` for S3, else the
            system's).
        max_listing_pages: pages one folder's listing may take (S3, Google Cloud Storage, Azure); past it the
            listing is refused as endless. A continuation token repeated is refused at once.
        max_listing_names: names one folder's listing may hold, all pages together.
        headers: sent with every request to an ``http(s)://`` source's server (``{"Authorization": "Bearer
            ..."}`` for a private one); never to another host a redirect leads to. Not used for ``s3://``
            (signed), ``gs://`` (google-auth's token), ``az://`` (azure-identity's token, or a SAS token) or the hub
            (``HF_TOKEN``).
    """

    connections: int = 16
    part_bytes: int = 16 * MiB
    timeout: float = 60.0
    min_rate: float = 16 * 1024
    retries: int = 8
    anonymous: bool = False
    ca_bundle: Optional[str] = None
    max_listing_pages: int = 10_000
    max_listing_names: int = 1_000_000
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.connections < 1:
            raise ValueError(f"connections: expected at least 1, got {self.connections}")
        if self.part_bytes < 64 * 1024:
            raise ValueError(f"part_bytes: expected at least 64 KiB, got {self.part_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {self.timeout}")
        if not self.min_rate > 0:
            raise ValueError(f"min_rate: expected a positive number of bytes a second, got {self.min_rate}")
        if self.max_listing_pages < 1 or self.max_listing_names < 1:
            raise ValueError("max_listing_pages, max_listing_names: expected at least 1")
        if self.retries < 0:
            raise ValueError(f"retries: expected 0 or more, got {self.retries}")
        for name, value in self.headers.items():
            if not name or any(c in name + value for c in "\r\n\0") or ":" in name:
                raise ValueError(f"headers: {name!r} is not a header name and value HTTP can send")
