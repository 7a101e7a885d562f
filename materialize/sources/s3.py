"""``s3://bucket/key`` and ``s3://bucket/prefix/`` sources, on AWS or any S3-compatible store.

Everything about credentials, endpoints and signing is botocore's (the
``remote`` extra): the standard credential chain (environment, profiles
and ``AWS_PROFILE``, SSO, web identity, container and instance roles), the
region, ``AWS_ENDPOINT_URL`` (and ``AWS_ENDPOINT_URL_S3``) for an
S3-compatible store, ``AWS_CA_BUNDLE``, and the addressing style the
configuration asks for. Listings and sizes come from botocore's own client.
The bytes come through :class:`~.http.Transport`: each ranged GET is sent
to a URL botocore presigned for that object (SigV4 in the query, the same
signature a signed request carries), so the body is received straight into
the tensor's memory. ``anonymous`` (the CLI's ``--no-sign-request``, as the
AWS CLI calls it) reads a public bucket unsigned.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from .http import Transport
from .listing import ListingPages
from .remotepath import ObjectInfo, RemotePath
from .settings import RemoteOptions

PRESIGNED_SECONDS = 3600
PRESIGNED_REUSE_SECONDS = 600  # a presigned URL is reused this long, well inside its validity
ANONYMOUS_HINT = "for a public bucket, read it unsigned: --no-sign-request (RemoteOptions(anonymous=True))"
CREDENTIALS_HINT = ("set AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role); "
                    + ANONYMOUS_HINT)


def _botocore():
    try:
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        raise CheckpointError("s3:// sources need botocore: pip install 'torch-materialize[remote]'") from None
    return botocore.session, UNSIGNED, Config


class S3Store:
    """One bucket: its listings and sizes through botocore, its bytes through presigned ranged GETs."""

    def __init__(self, bucket: str, options: RemoteOptions) -> None:
        session_module, unsigned, config_class = _botocore()
        session = session_module.get_session()
        self.bucket = bucket
        # SigV4 for the presigned GETs: botocore would presign SigV2, which newer regions and stores refuse
        config = config_class(signature_version=unsigned if options.anonymous else "s3v4")
        region = session.get_config_variable("region") or "us-east-1"  # botocore needs one to sign; S3 redirects
        self.client = session.create_client("s3", region_name=region, config=config)
        self.transport = Transport(options, ca_bundle=session.get_config_variable("ca_bundle"))
        self.anonymous = options.anonymous
        self._stats: dict[str, Optional[ObjectInfo]] = {}
        self._urls: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, what: str, key: str, **params: Any) -> Any:
        """A botocore call, its failures as one-line errors naming the object; ``None`` for a missing one."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return getattr(self.client, what)(Bucket=self.bucket, **params)
        except NoCredentialsError:
            raise CheckpointAccessError(f"no AWS credentials found: {CREDENTIALS_HINT}", path=self.url(key)) from None
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            if code == "NoSuchBucket":
                raise CheckpointNotFoundError(f"no such bucket {self.bucket!r}", path=self.url(key)) from None
            words = f"{code}: {error.get('Message')}" if error.get("Message") else code or f"HTTP {status}"
            if status in (401, 403):
                hint = ANONYMOUS_HINT if not self.anonymous and code in ("AccessDenied", "403") else CREDENTIALS_HINT
                if self.anonymous:
                    hint = "the bucket does not allow unsigned reads: leave --no-sign-request out and set credentials"
                raise CheckpointAccessError(f"access refused ({words}); {hint}", path=self.url(key)) from None
            raise CheckpointAccessError(f"S3 {what} failed ({words})", path=self.url(key)) from None
        except BotoCoreError as exc:
            raise CheckpointAccessError(f"S3 {what} failed: {str(exc).splitlines()[0]}", path=self.url(key)) from None

    def stat(self, key: str) -> Optional[ObjectInfo]:
        with self._lock:
            if key in self._stats:
                return self._stats[key]
        found = None
        if key:
            answer = self._call("head_object", key, Key=key)
            if answer is not None:
                found = ObjectInfo(int(answer["ContentLength"]), answer.get("ETag"))
        with self._lock:
            return self._stats.setdefault(key, found)

    def listing(self, key: str) -> Optional[tuple[list[str], list[str]]]:
        prefix = key + "/" if key else ""
        files: list[str] = []
        folders: list[str] = []
        pages = ListingPages(self.url(prefix), self.transport.options)
        token: Optional[str] = None
        while True:
            params: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
            if token:
                params["ContinuationToken"] = token
            page = self._call("list_objects_v2", key, **params)
            if page is None:
                return None
            found = [entry for entry in page.get("Contents", []) if entry["Key"][len(prefix):]]
            page_files = [entry["Key"][len(prefix):] for entry in found]
            page_folders = [entry["Prefix"][len(prefix):].rstrip("/") for entry in page.get("CommonPrefixes", [])]
            pages.page(page_files + page_folders)
            with self._lock:
                for entry in found:
                    self._stats[entry["Key"]] = ObjectInfo(int(entry["Size"]), entry.get("ETag"))
            files += page_files
            folders += page_folders
            token = pages.next_token(page.get("NextContinuationToken") if page.get("IsTruncated") else None)
            if token is None:
                break
        if not files and not folders:
            return None
        return files, folders

    def _presigned(self, key: str) -> str:
        now = time.monotonic()
        with self._lock:
            cached = self._urls.get(key)
            if cached and now - cached[1] < PRESIGNED_REUSE_SECONDS:
                return cached[0]
        from botocore.exceptions import NoCredentialsError

        try:
            url = self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": key},
                                                     ExpiresIn=PRESIGNED_SECONDS)
        except NoCredentialsError:
            raise CheckpointAccessError(f"no AWS credentials found: {CREDENTIALS_HINT}", path=self.url(key)) from None
        with self._lock:
            self._urls[key] = (url, now)
        return url

    def read_into(self, key: str, offset: int, views: list[memoryview], *, tensor: Optional[str]) -> None:
        info = self.stat(key)
        if info is None:
            raise CheckpointNotFoundError("no such object", path=self.url(key), tensor=tensor)
        self.transport.read_into(lambda: (self._presigned(key), {}), offset, views, size=info.size, etag=info.etag,
                                 name=self.url(key), tensor=tensor)

    def close(self) -> None:
        self.transport.close()


def open_s3(url: str, options: RemoteOptions) -> RemotePath:
    """The object, or the folder (a prefix), ``s3://bucket/key`` names."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise CheckpointError("names no bucket (s3://BUCKET/key)", path=url)
    store = S3Store(bucket, options)
    if not key or key.endswith("/"):
        return RemotePath(store, key, folder=True)
    return RemotePath(store, key)  # an object, or a prefix written without its slash: the store is asked which
