"""The S3 test server checks what S3 checks: signatures, key ids, presigned URLs, anonymous access, ETags, ranges."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import importlib.util

import pytest

# moto's server (and boto3 with it) is in requirements-dev, not in the oldest floors; looked up, not imported (0.5 s).
if importlib.util.find_spec("moto") is None:
    pytest.skip("moto's S3 server is not installed", allow_module_level=True)

import botocore.session  # noqa: E402
from botocore import UNSIGNED  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from s3_server import S3Server  # noqa: E402

PAYLOAD = bytes(range(256)) * 5


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.make_bucket("private")
        server.make_bucket("public", public=True)
        for bucket in ("private", "public"):
            server.put(bucket, "models/tiny/model.safetensors", PAYLOAD)
            server.put(bucket, "models/tiny/config.json", b"{}")
            server.put(bucket, "models/other/model.safetensors", b"other")
            server.put(bucket, "top.bin", b"top")
        yield server


def _botocore_client(s3: S3Server, **overrides: str):
    """A client made by plain botocore, as the sources make theirs."""
    keys = {"aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key, **overrides}
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=s3.endpoint, region_name=s3.region, config=Config(retries={"max_attempts": 1}), **keys)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.headers, answer.read()  # headers: looked up whatever their case
    finally:
        connection.close()


def _refusal(call) -> tuple[int, str]:
    with pytest.raises(ClientError) as caught:
        call()
    return caught.value.response["ResponseMetadata"]["HTTPStatusCode"], caught.value.response["Error"]["Code"]


def test_the_right_keys_read_and_a_wrong_secret_or_an_unknown_key_id_is_403(s3):
    good = _botocore_client(s3)
    wrong_secret = _botocore_client(s3, aws_secret_access_key="not-" + s3.secret_key)
    unknown_key = _botocore_client(s3, aws_access_key_id="AKIAUNKNOWNUNKNOWN00")
    key = {"Bucket": "private", "Key": "models/tiny/model.safetensors"}

    assert good.get_object(**key)["Body"].read() == PAYLOAD
    assert _refusal(lambda: wrong_secret.get_object(**key)) == (403, "SignatureDoesNotMatch")
    assert _refusal(lambda: unknown_key.get_object(**key)) == (403, "InvalidAccessKeyId")


@pytest.mark.parametrize("signature_version", [None, "s3v4"], ids=["botocore-default", "s3v4"])
def test_a_presigned_url_serves_a_range_with_206(s3, signature_version):
    config = {"signature_version": signature_version} if signature_version else {}
    url = s3.client(**config).generate_presigned_url(
        "get_object", Params={"Bucket": "private", "Key": "models/tiny/model.safetensors"}, ExpiresIn=600)

    status, headers, body = _get(url, {"Range": "bytes=10-99"})

    assert status == 206 and body == PAYLOAD[10:100]
    assert headers["Content-Range"] == f"bytes 10-99/{len(PAYLOAD)}" and headers["Content-Length"] == "90"


@pytest.mark.parametrize("signature_version", [None, "s3v4"], ids=["botocore-default", "s3v4"])
def test_a_presigned_url_tampered_with_or_expired_is_refused(s3, signature_version):
    client = s3.client(**({"signature_version": signature_version} if signature_version else {}))
    key = {"Bucket": "private", "Key": "models/tiny/model.safetensors"}
    url = client.generate_presigned_url("get_object", Params=key, ExpiresIn=600)
    tampered = url.replace("Signature=", "Signature=0")
    other_key = url.replace("models/tiny/model.safetensors", "models/other/model.safetensors")
    expired = client.generate_presigned_url("get_object", Params=key, ExpiresIn=-60)

    for refused, code in ((tampered, b"SignatureDoesNotMatch"), (other_key, b"SignatureDoesNotMatch"),
                          (expired, b"AccessDenied")):
        status, _, body = _get(refused)
        assert status == 403 and b"<Code>" + code + b"</Code>" in body, (refused, body)


def test_if_match_with_a_wrong_etag_is_412_and_with_the_right_one_serves(s3):
    client = s3.client()
    key = {"Bucket": "private", "Key": "models/tiny/model.safetensors"}
    etag = client.head_object(**key)["ETag"]
    url = client.generate_presigned_url("get_object", Params=key, ExpiresIn=600)

    assert _refusal(lambda: client.get_object(IfMatch='"0123456789abcdef0123456789abcdef"', **key)) == (
        412, "PreconditionFailed")
    assert _get(url, {"Range": "bytes=0-9", "If-Match": '"0123456789abcdef0123456789abcdef"'})[0] == 412
    status, headers, body = _get(url, {"Range": "bytes=0-9", "If-Match": etag})
    assert status == 206 and body == PAYLOAD[:10] and headers["ETag"] == etag


def test_list_objects_v2_with_a_prefix_and_a_delimiter(s3):
    listed = s3.client().list_objects_v2(Bucket="private", Prefix="models/", Delimiter="/")
    inside = s3.client().list_objects_v2(Bucket="private", Prefix="models/tiny/", Delimiter="/")

    assert "Contents" not in listed
    assert [p["Prefix"] for p in listed["CommonPrefixes"]] == ["models/other/", "models/tiny/"]
    assert [(o["Key"], o["Size"]) for o in inside["Contents"]] == [
        ("models/tiny/config.json", 2), ("models/tiny/model.safetensors", len(PAYLOAD))]


def test_unsigned_requests_read_a_public_bucket_and_are_403_on_a_private_one(s3):
    unsigned = botocore.session.get_session().create_client(
        "s3", endpoint_url=s3.endpoint, region_name=s3.region,
        config=Config(signature_version=UNSIGNED, retries={"max_attempts": 1}))

    status, _, body = _get(s3.url("public", "models/tiny/model.safetensors"), {"Range": "bytes=10-99"})
    assert status == 206 and body == PAYLOAD[10:100]
    assert _get(s3.url("private", "models/tiny/model.safetensors"))[0] == 403
    assert _get(s3.url("public", "models/tiny/absent.bin"))[0] == 404  # ListBucket is allowed: S3 says 404
    assert _get(s3.url("private", "models/tiny/absent.bin"))[0] == 403

    listed = unsigned.list_objects_v2(Bucket="public", Prefix="models/tiny/", Delimiter="/")
    assert [o["Key"] for o in listed["Contents"]] == ["models/tiny/config.json", "models/tiny/model.safetensors"]
    assert _refusal(lambda: unsigned.list_objects_v2(Bucket="private")) == (403, "AccessDenied")
    assert unsigned.get_object(Bucket="public", Key="top.bin")["Body"].read() == b"top"
    assert _refusal(lambda: unsigned.head_object(Bucket="private", Key="top.bin"))[0] == 403
    assert _refusal(lambda: unsigned.put_object(Bucket="public", Key="new.bin", Body=b"x")) == (403, "AccessDenied")


def test_env_alone_reaches_the_server_with_path_style_urls_for_an_ip_endpoint(s3, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_S3_ADDRESSING_STYLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    client = botocore.session.get_session().create_client("s3")  # endpoint, keys and region all from env()
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))

    body = client.get_object(Bucket="private", Key="top.bin")["Body"].read()

    assert body == b"top"
    assert sent == [f"{s3.endpoint}/private/top.bin"]  # an IP endpoint: path-style, the bucket in the path
    assert s3.started_in > 0
