"""An S3 endpoint for the tests: moto's server in a subprocess, with every request's signature and permissions checked.

moto checks signatures only once ``INITIAL_NO_AUTH_ACTION_COUNT`` actions have run unchecked; the server is started
with that count at 3, which :class:`S3Server` spends creating an IAM user, its access key and a policy allowing
``s3:*``. From then on a wrong secret is 403 SignatureDoesNotMatch and an unknown key id 403 InvalidAccessKeyId.

moto 5.2.5 answers 500 (a KeyError on the missing ``Authorization`` header) to every request that carries no such
header once checks are on: presigned URLs and anonymous reads of a public bucket. Real S3 serves both, and the
sources under test use both (presigned links, ``--no-sign-request``), so the server this module starts (run as a
script) first wraps moto's check: a presigned URL's signature (SigV2 or SigV4 query) is verified against the key's
secret and its expiry, and then the key's IAM policies are applied as for a signed request; a request with no
signature at all is allowed only where the bucket's policy allows the action to ``"Principal": "*"`` (or, for an
object, where its ACL is public-read), and is 403 AccessDenied otherwise.

``/moto-api/reset-auth`` stays open, as in any moto server: a local test endpoint, never a model of S3's security.

:class:`InProcessS3Server` is moto's S3 on a thread of the test's own process instead, with no signature checked and
switches that make its listings misbehave (endless pages, names no store should list), for the listing tests.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from itertools import count
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Optional
from urllib.parse import parse_qs, quote, urlencode

REGION = "us-east-1"
_UNCHECKED_SETUP_ACTIONS = 3  # CreateUser, CreateAccessKey, PutUserPolicy
_USER = "materialize-tests"
_ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
# The setup calls run before checks start; moto accepts any key for them, but they must still be signed.
_SETUP_KEY_ID, _SETUP_SECRET = "AKIASETUPSETUPSETUP0", "setup-secret"


class S3Server:
    """moto's S3 in server mode on 127.0.0.1, started on entry and stopped on exit.

    One per test module is the intent (a module-scoped fixture): starting it costs a Python start-up plus moto's
    imports, about a second on the test machine; ``started_in`` holds the measured seconds.
    """

    region = REGION

    def __init__(self, *, start_timeout: float = 60.0, stop_timeout: float = 10.0) -> None:
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.endpoint = ""
        self.access_key = ""
        self.secret_key = ""
        self.started_in = 0.0
        self._process: subprocess.Popen | None = None
        self._log: BinaryIO | None = None
        self._plain_client: Any = None

    def __enter__(self) -> S3Server:
        began = time.monotonic()
        # The server's request log would fill a pipe no one reads and stall it: it goes to a file, read on failure.
        self._log = tempfile.TemporaryFile()
        try:
            for _ in range(3):  # a port found free may be taken before the server binds it: try another
                port = _free_port()
                self._process = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), str(port)],
                    env=_server_environment(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                )
                if self._wait_until_answering(port, began):
                    break
                self._stop_process()
            else:
                raise RuntimeError(f"moto's server did not start:\n{self._log_tail()}")
            self.endpoint = f"http://127.0.0.1:{port}"
            self._create_user()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        self.started_in = time.monotonic() - began
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._plain_client = None
        try:
            self._stop_process()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    # ------------------------------------------------------------------ what a client needs

    def env(self) -> dict[str, str]:
        """The AWS_* variables a client process needs to reach this server and nothing else.

        The config and credentials files point at paths that do not exist, so no profile on the machine running
        the tests can add or override anything; instance metadata is off, so a miss cannot wait on 169.254.169.254.
        """
        nowhere = Path(tempfile.gettempdir()) / "materialize-tests-no-aws-config" / "absent"
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(nowhere / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(nowhere / "credentials"),
        }

    def client(self, *, access_key: str | None = None, secret_key: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client signed with this server's user (or the keys given, to test refusals).

        ``config`` goes to ``botocore.config.Config`` (``signature_version``, ``retries``, ...). The plain client is
        made once and shared (making one costs a few tenths of a second: botocore loads S3's model each time).
        """
        import boto3
        from botocore.config import Config

        plain = access_key is None and secret_key is None and not config
        if plain and self._plain_client is not None:
            return self._plain_client
        config.setdefault("retries", {"max_attempts": 1})  # a refusal is the answer under test, never retried
        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=access_key or self.access_key, aws_secret_access_key=secret_key or self.secret_key,
            config=Config(**config),
        )
        if plain:
            self._plain_client = client
        return client

    def make_bucket(self, bucket: str, *, public: bool = False) -> None:
        """A bucket; ``public`` adds a policy letting anyone, unsigned, GetObject its keys and ListBucket it."""
        client = self.client()
        client.create_bucket(Bucket=bucket)
        if public:
            client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(_public_policy(bucket)))

    def put(self, bucket: str, key: str, data: bytes | str | os.PathLike) -> str:
        """Store ``data`` (bytes, or a file's path) at ``key``; returns the object's ETag as S3 sends it (quoted)."""
        body = data if isinstance(data, bytes) else Path(data).read_bytes()
        return self.client().put_object(Bucket=bucket, Key=key, Body=body)["ETag"]

    def url(self, bucket: str, key: str = "") -> str:
        """The object's (or bucket's) plain path-style HTTP URL: what an unsigned reader fetches."""
        return f"{self.endpoint}/{bucket}/{key}" if key else f"{self.endpoint}/{bucket}"

    # ------------------------------------------------------------------ start and stop

    def _wait_until_answering(self, port: int, began: float) -> bool:
        """True once the server answers on ``port``; False if it exited first (the port was taken)."""
        while time.monotonic() - began < self.start_timeout:
            if self._process.poll() is not None:
                return False
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                try:
                    # A moto-api page: an S3 or IAM call here would spend one of the unchecked setup actions.
                    connection.request("GET", "/moto-api/data.json")
                    connection.getresponse().read()
                    return True
                finally:
                    connection.close()
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"moto's server did not answer within {self.start_timeout}s:\n{self._log_tail()}")

    def _create_user(self) -> None:
        import boto3

        iam = boto3.session.Session().client(
            "iam", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=_SETUP_KEY_ID, aws_secret_access_key=_SETUP_SECRET,
        )
        iam.create_user(UserName=_USER)
        key = iam.create_access_key(UserName=_USER)["AccessKey"]
        iam.put_user_policy(UserName=_USER, PolicyName="s3-all", PolicyDocument=json.dumps(_ALLOW_S3))
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]


class InProcessS3Server:
    """moto's S3 on a thread of this process, started on entry and stopped on exit: no Python to start, and no
    signature checked (:class:`S3Server` checks them), for tests of what a client does with the answers of a store
    that misbehaves. Its switches, set on the instance, make every ListObjectsV2 answer misbehave:

    - ``listing_fault``: ``"same-token"``, each page says more remain and names the token it named before;
      ``"new-tokens"``, a new token each time; moto, which knows none of them, answers its first page whatever
      token is asked. ``None``: moto's own paging.
    - ``listed_names``: keys each page adds as objects, whatever the prefix and delimiter asked (URL-encoded
      where the request asks ``encoding-type=url``, as botocore's always do).

    ``page_size`` (``None``: moto's 1000) entries, keys and common prefixes together, make a listing page where the
    request asks no ``max-keys``.

    ``list_requests`` counts the ListObjectsV2 requests answered. Requests go one to a connection (HTTP/1.0), so
    no kept-alive connection holds a thread of the server past its ``with`` block.
    """

    region = REGION

    def __init__(self) -> None:
        self.endpoint = ""
        self.listing_fault: Optional[str] = None
        self.listed_names: tuple[str, ...] = ()
        self.page_size: Optional[int] = None
        self.list_requests = 0
        self._tokens = count(1)
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None
        self._moto: Any = None
        self._client: Any = None

    def __enter__(self) -> InProcessS3Server:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class OneRequestAConnection(MotoRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_request(self, *args: Any) -> None:
                pass

        self._moto = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._answer, threaded=True, request_handler=OneRequestAConnection)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"InProcessS3Server:{self._server.server_port}", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        return self

    def __exit__(self, *exc_info: object) -> None:
        from moto.s3.models import s3_backends

        self._client = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None
        s3_backends.reset()  # moto's buckets live in this process: none is left to another test

    def env(self) -> dict[str, str]:
        """The AWS_* variables a client needs to reach this server and nothing else (see :meth:`S3Server.env`);
        any key is accepted."""
        nowhere = Path(tempfile.gettempdir()) / "materialize-tests-no-aws-config" / "absent"
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "in-process", "AWS_SECRET_ACCESS_KEY": "any",
                "AWS_DEFAULT_REGION": self.region, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(nowhere / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(nowhere / "credentials")}

    def client(self) -> Any:
        """A boto3 S3 client of this server, made once (botocore loads S3's model for each new one)."""
        import boto3

        if self._client is None:
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name=self.region,
                                                          aws_access_key_id="in-process", aws_secret_access_key="any")
        return self._client

    def make_bucket(self, bucket: str, *, public: bool = False) -> None:
        """A bucket; ``public`` lets anyone, unsigned, GetObject its keys and ListBucket it (moto refuses an
        unsigned GET of an object otherwise, though it lists and checks no signature)."""
        self.client().create_bucket(Bucket=bucket)
        if public:
            self.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(_public_policy(bucket)))

    def put(self, bucket: str, key: str, data: bytes | str | os.PathLike) -> None:
        self.client().put_object(Bucket=bucket, Key=key,
                                 Body=data if isinstance(data, bytes) else Path(data).read_bytes())

    # ------------------------------------------------------------------ the misbehaving listing

    def _answer(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        if environ["REQUEST_METHOD"] != "GET" or query.get("list-type") != ["2"]:
            return self._moto(environ, start_response)
        with self._lock:
            self.list_requests += 1
        if self.listing_fault is not None or self.page_size is not None:
            kept = [(name, value) for name, values in query.items() for value in values
                    if name != "continuation-token" or self.listing_fault is None]
            if self.page_size is not None and "max-keys" not in query:
                kept.append(("max-keys", str(self.page_size)))
            environ = {**environ, "QUERY_STRING": urlencode(kept)}
        answered: dict[str, Any] = {}

        def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            answered.update(status=status, headers=headers)
            return lambda data: None

        result = self._moto(environ, keep)
        try:
            body = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        if answered["status"].startswith("200"):
            body = self._misbehave(body, encoded=query.get("encoding-type") == ["url"])
        headers = [(k, v) for k, v in answered["headers"] if k.lower() != "content-length"]
        start_response(answered["status"], headers + [("Content-Length", str(len(body)))])
        return [body]

    def _misbehave(self, body: bytes, *, encoded: bool) -> bytes:
        from xml.etree import ElementTree  # moto's own answer, made in this process

        root = ElementTree.fromstring(body)
        namespace = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""

        def set_text(parent: Any, tag: str, text: str) -> None:
            found = parent.find(namespace + tag)
            (found if found is not None else ElementTree.SubElement(parent, namespace + tag)).text = text

        for name in self.listed_names:
            entry = ElementTree.SubElement(root, namespace + "Contents")
            for tag, text in (("Key", quote(name, safe="/") if encoded else name), ("Size", "1"),
                              ("LastModified", "2026-01-01T00:00:00.000Z"), ("ETag", '"stand-in"'),
                              ("StorageClass", "STANDARD")):
                set_text(entry, tag, text)
        if self.listing_fault is not None:
            set_text(root, "IsTruncated", "true")
            token = "the-same-token" if self.listing_fault == "same-token" else f"token-{next(self._tokens)}"
            set_text(root, "NextContinuationToken", token)
        return ElementTree.tostring(root, encoding="utf-8", xml_declaration=True)


def _public_policy(bucket: str) -> dict[str, Any]:
    """A bucket policy letting anyone, unsigned, GetObject the bucket's keys and ListBucket it."""
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/*"},
        {"Effect": "Allow", "Principal": "*", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"},
    ]}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_environment() -> dict[str, str]:
    # No AWS_* of the machine's reaches the server; moto reads its own settings from the environment at import.
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "MOTO_"))}
    environment["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_UNCHECKED_SETUP_ACTIONS)
    return environment


# ---------------------------------------------------------------------- the server process


def _check_unsigned_requests_as_s3_does() -> None:
    """Wrap moto's request check so that presigned and anonymous requests are judged, not a 500 (see the module)."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.iam.access_control import S3IAMRequest

    checked_by_moto = ActionAuthenticatorMixin._authenticate_and_authorize_action

    def authenticate_and_authorize(self: Any, iam_request_cls: type, resource: str = "*") -> None:
        unchecked = ActionAuthenticatorMixin.request_count < settings.INITIAL_NO_AUTH_ACTION_COUNT
        if unchecked or iam_request_cls is not S3IAMRequest or "Authorization" in self.headers:
            return checked_by_moto(self, iam_request_cls, resource)
        query = _query(self)
        if "X-Amz-Signature" in query or "Signature" in query:
            return _check_presigned(self, query, resource)
        return _check_anonymous(self, resource)

    ActionAuthenticatorMixin._authenticate_and_authorize_action = authenticate_and_authorize

    # moto asks a bucket policy for "s3:HeadObject" on an unsigned HEAD, which no policy grants; S3 authorizes a
    # HEAD by s3:GetObject (there is no HeadObject permission), so a public object answers HEAD as it answers GET.
    from moto.s3.models import FakeBucket

    asked_by_moto = FakeBucket.get_permission

    def get_permission(self: Any, action: str, resource: str) -> Any:
        return asked_by_moto(self, "s3:GetObject" if action == "s3:HeadObject" else action, resource)

    FakeBucket.get_permission = get_permission


def _query(response: Any) -> dict[str, str]:
    from urllib.parse import parse_qsl, urlsplit

    return dict(parse_qsl(urlsplit(response.uri).query, keep_blank_values=True))


def _check_presigned(response: Any, query: dict[str, str], resource: str) -> None:
    """A presigned URL: its key must exist, its signature match, its time not be up, and the key's policy allow."""
    from moto.iam.access_control import S3IAMRequest
    from moto.s3.exceptions import S3AccessDeniedError, S3SignatureDoesNotMatchError

    if "X-Amz-Signature" in query:
        key_id, scope = query.get("X-Amz-Credential", "").partition("/")[::2]
    else:
        key_id, scope = query.get("AWSAccessKeyId", ""), f"00000000/{REGION}/s3/aws4_request"
    # moto's own request check does the key lookup and the policy check; it reads them from an Authorization header.
    headers = {name: value for name, value in response.headers.items()}
    headers["Authorization"] = f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders=host, Signature=-"
    request = S3IAMRequest(account_id=response.current_account, method=response.method, path=response.raw_path,
                           data=response.data, body=response.raw_body, headers=headers,
                           action=response._get_action())
    secret = request._access_key.create_credentials().secret_key
    matches = _sigv4_query_matches if "X-Amz-Signature" in query else _sigv2_query_matches
    try:
        signed, expired = matches(response, query, key_id, secret), _expired(query)
    except (KeyError, ValueError):  # a parameter missing or malformed: no signature can match
        signed, expired = False, False
    if not signed:
        raise S3SignatureDoesNotMatchError()
    if expired:
        raise S3AccessDeniedError()
    request.check_action_permitted(resource)


def _sigv4_query_matches(response: Any, query: dict[str, str], key_id: str, secret: str) -> bool:
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    _, region, service, _ = query["X-Amz-Credential"].split("/", 1)[1].split("/")
    raw_query = response.uri.partition("?")[2]
    unsigned_query = "&".join(part for part in raw_query.split("&") if not part.startswith("X-Amz-Signature="))
    signed_headers = query.get("X-Amz-SignedHeaders", "host").split(";")
    host = response.headers.get("Host", "")
    request = AWSRequest(method=response.method, url=f"http://{host}{response.raw_path}?{unsigned_query}",
                         headers={name: value for name, value in response.headers.items()
                                  if name.lower() in signed_headers and name.lower() != "host"})
    request.context["timestamp"] = query["X-Amz-Date"]
    signer = S3SigV4QueryAuth(Credentials(key_id, secret), service, region, expires=int(query["X-Amz-Expires"]))
    string_to_sign = signer.string_to_sign(request, signer.canonical_request(request))
    return signer.signature(string_to_sign, request) == query["X-Amz-Signature"]


def _sigv2_query_matches(response: Any, query: dict[str, str], key_id: str, secret: str) -> bool:
    from urllib.parse import urlsplit

    from botocore.auth import HmacV1Auth
    from botocore.awsrequest import HTTPHeaders
    from botocore.credentials import Credentials

    class SignedUntil(HmacV1Auth):
        def _get_date(self) -> str:  # a query-signed request signs its expiry where a header-signed one its date
            return query.get("Expires", "")

    headers = HTTPHeaders()
    for name, value in query.items():
        if name.lower().startswith("x-amz-") or name.lower() in ("content-md5", "content-type"):
            headers[name] = value
    split = urlsplit(f"http://host{response.raw_path}?{response.uri.partition('?')[2]}")
    signature = SignedUntil(Credentials(key_id, secret)).get_signature(response.method, split, headers)
    return signature == query["Signature"]


def _expired(query: dict[str, str]) -> bool:
    import calendar

    if "Expires" in query:
        return int(query["Expires"]) < time.time()
    signed_at = calendar.timegm(time.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
    return signed_at + int(query["X-Amz-Expires"]) < time.time()


_PERMISSION_OF = {"HeadObject": "GetObject", "HeadBucket": "ListBucket"}


def _check_anonymous(response: Any, resource: str) -> None:
    """No signature: allowed where the bucket's policy allows anyone the action, or the object's ACL is public-read."""
    from moto.iam.access_control import PermissionResult
    from moto.s3.exceptions import S3AccessDeniedError
    from moto.s3.models import s3_backends
    from moto.utilities.utils import get_partition

    backend = s3_backends[response.current_account][get_partition(response.region)]
    bucket = backend.buckets.get(response.bucket_name or "")
    # S3 authorizes a HEAD by the permission of its GET (HeadObject is no IAM action; HeadBucket is ListBucket)
    named = response.data.get("Action") or response._get_action()  # what moto's S3 handler set, where it did
    action = "s3:" + _PERMISSION_OF.get(named, named)
    if bucket is not None:
        allowed = bucket.get_permission(action, resource)
        if allowed == PermissionResult.PERMITTED:
            return
        key_name = resource.partition(f":::{bucket.name}/")[2]
        key = bucket.keys.get(key_name) if key_name and allowed != PermissionResult.DENIED else None
        if key is not None and action == "s3:GetObject" and key.acl is not None and key.acl.public_read:
            return
    raise S3AccessDeniedError()


def _serve(port: int) -> None:
    import logging

    import moto.server

    _check_unsigned_requests_as_s3_does()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request; errors still logged
    moto.server.main(["-H", "127.0.0.1", "-p", str(port)])


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
