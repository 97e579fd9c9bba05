"""The OCI registry store without a registry (tests/e2e/test_oci_registry.py runs a real one): store URLs are
parsed strictly, WWW-Authenticate challenges as RFC 9110 writes them, a bundle's manifest is canonical (two
publishers write the same bytes), a blob GET redirected to storage carries no credentials, a dropped blob
download resumes with Range, bytes that are not the digest's are refused, and neither the password nor a token
appears in any message or log line. The registries here are tests/loopback.py servers on 127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import bundle
from llamabundle.errors import StoreError, UsageError, VerifyError
from llamabundle.log import Log
from llamabundle.net import NetworkError
from llamabundle.settings import Settings
from llamabundle.store import open_store
from llamabundle.store.oci import OciStore, RegistryError, parse_challenges, parse_url
from llamabundle.store.oci import image as image_mod
from llamabundle.store.oci.store import zip_epoch
from tests.loopback import Loopback, Reply, Request, ranged
from tests.probing import make_zip

PASSWORD = "pa55-W0rd-never-shown"
TOKEN = "tok-0123456789abcdef-never-shown"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def captured() -> tuple[Log, io.StringIO]:
    buf = io.StringIO()
    return Log(console=Console(file=buf, width=200, force_terminal=False)), buf


def errors(code: str, message: str) -> bytes:
    return json.dumps({"errors": [{"code": code, "message": message}]}).encode()


# ------------------------------------------------------------------------------------------------ URLs


@pytest.mark.parametrize(("url", "host", "port", "repo", "scheme"), [
    ("oci://ghcr.io/owner/bundles", "ghcr.io", None, "owner/bundles", "https"),
    ("oci://GHCR.io/owner/bundles", "ghcr.io", None, "owner/bundles", "https"),
    ("oci://registry.example.com:5000/a/b/c", "registry.example.com", 5000, "a/b/c", "https"),
    ("oci://127.0.0.1:5000/test/bundles", "127.0.0.1", 5000, "test/bundles", "http"),
    ("oci://localhost/x", "localhost", None, "x", "http"),
    ("oci://[::1]:8080/my-repo.v2/sub__x", "::1", 8080, "my-repo.v2/sub__x", "http"),
    ("oci://reg/a--b/c_d/e.f", "reg", None, "a--b/c_d/e.f", "https"),
])
def test_a_store_url_names_host_port_and_repository(url: str, host: str, port: int | None, repo: str,
                                                    scheme: str) -> None:
    ref = parse_url(url)
    assert (ref.host, ref.port, ref.repo, ref.scheme) == (host, port, repo, scheme)
    assert ref.url == url.replace("GHCR", "ghcr") and ref.location("sha256:" + "0" * 64) == f"{ref.url}@sha256:{'0' * 64}"
    assert parse_url(url, insecure=True).scheme == "http"


@pytest.mark.parametrize(("url", "why"), [
    ("oci://", "names no host"),
    ("oci://host", "names no repository"),
    ("oci://host/", "names no repository"),
    ("oci://host/a/", "ends with '/'"),
    ("oci://host/Owner/bundles", "lower case"),
    ("oci://host/a//b", "is not a repository name"),
    ("oci://host/-a", "is not a repository name"),
    ("oci://host/a_-b", "is not a repository name"),
    ("oci://host/a/b:latest", "names an image"),
    ("oci://host/a/b@sha256:" + "0" * 64, "names an image"),
    ("oci://host:0/a", "is not a port"),
    ("oci://host:99999/a", "is not a port"),
    ("oci://host:x/a", "is not a port"),
    ("oci://ho_st/a", "is not a host name"),
    ("oci://-host/a", "is not a host name"),
    ("oci://[zz::1]/a", "is not an IPv6 address"),
    ("oci://host/a?tag=1", "a query or a fragment"),
    ("oci://host/" + "a" * 260, "longer than 255"),
])
def test_a_bad_store_url_is_a_usage_error_saying_why(url: str, why: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_url(url)
    assert why in e.value.why and e.value.exit_code == 2 and e.value.fix


def test_a_password_in_the_url_is_refused_and_never_repeated() -> None:
    with pytest.raises(UsageError) as e:
        parse_url(f"oci://user:{PASSWORD}@ghcr.io/o/r")
    assert PASSWORD not in e.value.render() and "LLAMABUNDLE_REGISTRY_PASSWORD" in e.value.fix


def test_open_store_hands_the_registry_settings_to_the_oci_store(tmp_path: Path) -> None:
    base = Settings(cache_dir=tmp_path, github_token="gh-token", connect_timeout=3.0)
    ghcr = open_store("oci://ghcr.io/o/bundles", settings=base)
    assert isinstance(ghcr, OciStore) and ghcr.url == "oci://ghcr.io/o/bundles"
    assert (ghcr.client.user, ghcr.client.password, ghcr.client.timeout[0]) == ("llamabundle", "gh-token", 3.0)
    other = open_store("oci://registry.example.com/o/b", settings=base)
    assert isinstance(other, OciStore) and other.client.password is None  # the GitHub token goes to ghcr.io only
    mine = Settings(cache_dir=tmp_path, github_token="gh-token", registry_user="me", registry_password="pw",
                    registry_insecure=True)
    store = open_store("oci://registry.example.com/o/b", settings=mine)
    assert isinstance(store, OciStore)
    assert (store.client.user, store.client.password, store.ref.scheme) == ("me", "pw", "http")
    assert open_store("oci://127.0.0.1:5000/x").url == "oci://127.0.0.1:5000/x"
    with pytest.raises(UsageError) as e:
        open_store("ftp://host/x")
    assert "oci://HOST[:PORT]/REPO" in e.value.fix
    with pytest.raises(UsageError):
        open_store("oci://host/Bad", settings=base)


def test_the_settings_read_the_registry_variables(tmp_path: Path) -> None:
    s = Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path), "LLAMABUNDLE_REGISTRY_USER": "u",
                           "LLAMABUNDLE_REGISTRY_PASSWORD": "p", "LLAMABUNDLE_REGISTRY_INSECURE": "1"})
    assert (s.registry_user, s.registry_password, s.registry_insecure) == ("u", "p", True)
    s = Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path), "LLAMABUNDLE_REGISTRY_INSECURE": "true"})
    assert (s.registry_user, s.registry_password, s.registry_insecure) == (None, None, False)  # exactly "1"


# ------------------------------------------------------------------------------------------------ challenges


def test_challenges_are_parsed_as_rfc_9110_writes_them() -> None:
    (c,) = parse_challenges('Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:o/r:pull"')
    assert c.scheme == "bearer" and dict(c.params) == {"realm": "https://ghcr.io/token", "service": "ghcr.io",
                                                        "scope": "repository:o/r:pull"}
    two = parse_challenges('Basic realm="Registry Realm", Bearer realm="https://a/t", service=reg , error=invalid_token')
    assert [(x.scheme, dict(x.params)) for x in two] == [
        ("basic", {"realm": "Registry Realm"}),
        ("bearer", {"realm": "https://a/t", "service": "reg", "error": "invalid_token"})]
    (q,) = parse_challenges(r'Bearer REALM="https://a/t?x=\"y\"",scope="repository:a:pull repository:b:pull"')
    assert q.params == {"realm": 'https://a/t?x="y"', "scope": "repository:a:pull repository:b:pull"}
    assert [x.scheme for x in parse_challenges("Negotiate abc==, Basic realm=x")] == ["negotiate", "basic"]
    assert parse_challenges("") == []


# ------------------------------------------------------------------------------------------------ the manifest


def test_a_bundles_manifest_is_canonical_and_the_same_for_every_publisher(tmp_path: Path) -> None:
    zip_path, m = make_zip(tmp_path)
    store = OciStore("oci://127.0.0.1:9/x", log=Log(quiet=True))
    made = []
    for n in range(2):  # two publishers: the blobs and the manifest come out byte for byte the same
        (tmp_path / f"p{n}").mkdir()
        layers, blobs, config = store._prepare(zip_path, m, tmp_path / f"p{n}")
        raw = image_mod.build(m, config, layers, zip_name=zip_path.name, zip_sha256="ab" * 32, zip_size=123)
        made.append((raw, {d: p.read_bytes() for d, p in blobs.items()}))
    assert made[0] == made[1]
    raw, blobs = made[0]
    doc = json.loads(raw)
    assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert b" " not in raw and b"\n" not in raw
    assert doc["schemaVersion"] == 2 and doc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert doc["artifactType"] == doc["config"]["mediaType"] == "application/vnd.llamabundle.bundle.v1+json"
    assert doc["config"]["digest"] == "sha256:" + hashlib.sha256(m.text().encode()).hexdigest()
    assert set(doc["annotations"]) == {"dev.llamabundle.key", "dev.llamabundle.name", "dev.llamabundle.zip.name",
                                       "dev.llamabundle.zip.sha256", "dev.llamabundle.zip.size"}  # no built_at: no time
    for layer in doc["layers"]:
        assert layer["mediaType"] == "application/vnd.llamabundle.file.v1+zstd"
        assert layer["digest"] == "sha256:" + hashlib.sha256(blobs[layer["digest"]]).hexdigest()
    back = image_mod.parse(raw, digest=image_mod.sha256_digest(raw), where="it", fix="")
    assert back.covers(m) is None and back.key == m.key and back.zip_size == 123
    assert {p: mode for la in back.layers for p, mode in la.paths.items()}["llama-server"] == "0755"


@pytest.mark.parametrize(("edit", "why"), [
    (lambda d: d.update(schemaVersion=1), "schemaVersion"),
    (lambda d: d["config"].update(mediaType="application/vnd.oci.image.config.v1+json"), "another kind of image"),
    (lambda d: d["layers"][0].update(digest="sha256:xyz"), "digest is not"),
    (lambda d: d["annotations"].update({"dev.llamabundle.zip.name": "../evil.zip"}), "not a plain *.zip"),
    (lambda d: d["layers"][0]["annotations"].update({"dev.llamabundle.file.paths": "[]"}), "paths and modes"),
])
def test_a_manifest_not_as_build_writes_it_is_refused(tmp_path: Path, edit: object, why: str) -> None:
    zip_path, m = make_zip(tmp_path)
    layers, _blobs, config = OciStore("oci://127.0.0.1:9/x", log=Log(quiet=True))._prepare(zip_path, m, tmp_path)
    doc = json.loads(image_mod.build(m, config, layers, zip_name="b.zip", zip_sha256="ab" * 32, zip_size=1))
    edit(doc)  # type: ignore[operator]
    raw = json.dumps(doc).encode()
    with pytest.raises(image_mod.ImageError) as e:
        image_mod.parse(raw, digest=image_mod.sha256_digest(raw), where="the manifest", fix="publish again")
    assert why in e.value.why and e.value.exit_code == 5


def test_zip_epoch_is_built_at_as_unix_time() -> None:
    assert zip_epoch("2025-03-01T12:00:00Z") == 1740830400
    assert zip_epoch(None) is None and zip_epoch("not a time") is None


# ------------------------------------------------------------------------------------------------ a fake registry

BLOB = bytes(range(256)) * 4096  # 1 MiB
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


class FakeRegistry:
    """A registry answering one blob GET with a redirect to `storage`, behind Bearer (a token from its own
    realm, for the right Basic credentials) or Basic auth."""

    def __init__(self, scheme: str, storage: Loopback) -> None:
        self.scheme, self.storage = scheme, storage
        self.server = Loopback(self.answer, methods=METHODS)
        self.basic = "Basic " + base64.b64encode(f"u:{PASSWORD}".encode()).decode()

    def answer(self, req: Request) -> Reply:
        auth = req.headers.get("authorization", "")
        if req.path.startswith("/token"):
            if auth != self.basic:
                return Reply(401, {"Content-Type": "application/json"}, errors("UNAUTHORIZED", "bad credentials"))
            return Reply(200, {"Content-Type": "application/json"}, json.dumps({"token": TOKEN}).encode())
        if auth != (f"Bearer {TOKEN}" if self.scheme == "bearer" else self.basic):
            challenge = (f'Bearer realm="{self.server.url}/token",service="fake",scope="repository:r:pull"'
                         if self.scheme == "bearer" else 'Basic realm="fake"')
            return Reply(401, {"WWW-Authenticate": challenge}, errors("UNAUTHORIZED", "authentication required"))
        return Reply(307, {"Location": f"{self.storage.url}/data/{DIGEST}?sig=1"})


@pytest.mark.parametrize("scheme", ["bearer", "basic"])
def test_a_blob_redirected_to_storage_is_fetched_without_the_credentials(scheme: str) -> None:
    with Loopback(lambda req: ranged(req, BLOB)) as storage:
        fake = FakeRegistry(scheme, storage)
        with fake.server:
            log, buf = captured()
            store = OciStore(f"oci://127.0.0.1:{fake.server.port}/r", user="u", password=PASSWORD, log=log)
            with store.client.blob(DIGEST, len(BLOB), what="download it", mismatch=VerifyError) as stream:
                data = b"".join(iter(lambda: stream.read(1 << 16), b""))
            assert data == BLOB and stream.received == len(BLOB)
            sent = [r.headers.get("authorization", "") for r in fake.server.requests if not r.path.startswith("/token")]
    assert sent[0] == "" and sent[-1] == (f"Bearer {TOKEN}" if scheme == "bearer" else fake.basic)  # anonymous first
    assert [r.headers.get("authorization") for r in storage.requests] == [None]  # never to the storage host
    tokens = [r for r in fake.server.requests if r.path.startswith("/token")]
    assert len(tokens) == (1 if scheme == "bearer" else 0)
    assert PASSWORD not in buf.getvalue() and TOKEN not in buf.getvalue()


def test_a_dropped_blob_download_resumes_with_range() -> None:
    answers = iter([dict(cut=300_000), {}, {}])
    with Loopback(lambda req: ranged(req, BLOB, etag='"x"', **next(answers))) as storage:
        fake = FakeRegistry("bearer", storage)
        with fake.server:
            log, buf = captured()
            store = OciStore(f"oci://127.0.0.1:{fake.server.port}/r", user="u", password=PASSWORD, log=log, backoff=0.0)
            with store.client.blob(DIGEST, len(BLOB), what="download it", mismatch=VerifyError) as stream:
                data = b"".join(iter(lambda: stream.read(1 << 16), b""))
    assert data == BLOB
    ranges = [r.headers.get("range") for r in storage.requests]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=") and len(ranges) == 2
    assert "resuming at byte" in buf.getvalue()


@pytest.mark.parametrize(("body", "said"), [
    (BLOB[:-1] + b"!", "its bytes have the sha256"),  # same length, other bytes: found at the end
    (BLOB + b"more", "sends"),  # another length: found before a byte is read
])
def test_bytes_that_are_not_the_digests_are_refused(body: bytes, said: str) -> None:
    with Loopback(lambda req: ranged(req, body)) as storage:
        fake = FakeRegistry("basic", storage)
        with fake.server:
            store = OciStore(f"oci://127.0.0.1:{fake.server.port}/r", user="u", password=PASSWORD, log=Log(quiet=True))
            with pytest.raises(VerifyError) as e, \
                    store.client.blob(DIGEST, len(BLOB), what="download it", mismatch=VerifyError) as stream:
                while stream.read(1 << 16):
                    pass
    assert said in e.value.what


# ------------------------------------------------------------------------------------------------ secrets


def test_refused_credentials_are_a_clear_error_without_the_password() -> None:
    with Loopback(lambda req: Reply(404)) as storage:
        fake = FakeRegistry("bearer", storage)
        with fake.server:
            log, buf = captured()
            store = OciStore(f"oci://127.0.0.1:{fake.server.port}/r", user="u", password="wrong-" + PASSWORD, log=log)
            with pytest.raises(RegistryError) as e:
                store.lookup("ab" * 32)
    text = e.value.render()
    assert f"127.0.0.1:{fake.server.port}" in text and "refused the credentials" in text and "UNAUTHORIZED" in text
    assert "LLAMABUNDLE_REGISTRY_PASSWORD" in e.value.fix and e.value.exit_code == 6
    assert PASSWORD not in text + buf.getvalue()


def test_a_registry_that_echoes_secrets_has_them_redacted() -> None:
    """A hostile or careless registry repeats the token and the password in its error messages, after a 500 that
    is retried (and logged): neither reaches a message or the log."""
    seen: list[str] = []

    def answer(req: Request) -> Reply:
        auth = req.headers.get("authorization", "")
        if req.path.startswith("/token"):
            return Reply(200, {}, json.dumps({"token": TOKEN}).encode())
        if not auth:
            return Reply(401, {"WWW-Authenticate": f'Bearer realm="{reg.url}/token",service="s"'})
        seen.append(auth)
        if len(seen) == 1:
            return Reply(500, {}, errors("UNKNOWN", f"oops with {auth} and {PASSWORD}"))
        return Reply(403, {}, errors("DENIED", f"{auth} may not read; password {PASSWORD}"))

    with Loopback(answer, methods=METHODS) as reg:
        log, buf = captured()
        store = OciStore(f"oci://127.0.0.1:{reg.port}/r", user="u", password=PASSWORD, log=log, backoff=0.0)
        with pytest.raises(RegistryError) as e:
            store.lookup("ab" * 32)
    text = e.value.render() + buf.getvalue()
    assert "DENIED" in text and "***" in text and "HTTP 500; retry" in buf.getvalue()
    assert TOKEN not in text and PASSWORD not in text


def test_no_credentials_against_a_basic_registry_says_what_to_set() -> None:
    with Loopback(lambda req: Reply(401, {"WWW-Authenticate": 'Basic realm="r"'}, errors("UNAUTHORIZED", "no"))) as reg:
        with pytest.raises(RegistryError) as e:
            OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True)).lookup("ab" * 32)
    assert "UNAUTHORIZED" in e.value.why and "LLAMABUNDLE_REGISTRY_USER" in e.value.fix


# ------------------------------------------------------------------------------------------------ errors, publish


def test_a_registry_that_is_not_there_and_an_unknown_repository_are_clear_errors() -> None:
    with Loopback(lambda req: Reply(404, {}, errors("NAME_UNKNOWN", "repository name not known to registry"))) as reg:
        with pytest.raises(RegistryError) as e:
            OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True)).list_entries()
        port = reg.port
    assert "NAME_UNKNOWN" in e.value.why and "first publish" in e.value.fix
    with pytest.raises(NetworkError) as refused:  # the server is closed: nothing listens there now
        OciStore(f"oci://127.0.0.1:{port}/r", log=Log(quiet=True)).lookup("ab" * 32)
    assert "connection refused" in refused.value.why and "unreachable" in refused.value.what
    with pytest.raises(StoreError):
        OciStore(f"oci://127.0.0.1:{port}/r", log=Log(quiet=True)).lookup("not a key")


def test_a_zip_that_disagrees_with_its_manifest_pushes_nothing(tmp_path: Path) -> None:
    zip_path, m = make_zip(tmp_path)
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(zip_path) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, b"MIT Licensf\n" if info.filename == "LICENSE" else zin.read(info))
    with Loopback(lambda req: Reply(404, {}, errors("MANIFEST_UNKNOWN", "manifest unknown")), methods=METHODS) as reg:
        with pytest.raises(VerifyError) as e:
            OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True)).publish(bad, m)
        assert {r.method for r in reg.requests} == {"GET"}  # the lookup; no blob was pushed
    assert e.value.what == "bad.zip:LICENSE does not match its sha256 in bundle.json"


def test_an_unpacked_bundle_zip_is_one_pack_would_make(tmp_path: Path) -> None:
    """What fetch relies on: pack of the unpacked files, dated by built_at, gives the published zip back."""
    zip_path, m = make_zip(tmp_path)
    out = tmp_path / "unpacked"
    bundle.extract(zip_path, out)
    again = bundle.pack(out, tmp_path / "again.zip", source_date_epoch=zip_epoch(m.built_at))
    assert again.read_bytes() == zip_path.read_bytes()


@pytest.mark.parametrize("mount", [201, 202])
def test_a_blob_another_repository_holds_is_mounted_or_uploaded(mount: int) -> None:
    """HEAD first; then the mount: 201 is done, 202 is an upload session the registry opened instead (cancelled),
    after which the blob goes up in one PUT of the whole blob after a POST."""
    def answer(req: Request) -> Reply:
        if req.method == "HEAD":
            return Reply(404, length=False)
        if req.method == "POST" and "mount=" in req.path:
            return Reply(mount, {"Location": "/v2/r/blobs/uploads/mounted-session"})
        if req.method == "POST":
            return Reply(202, {"Location": f"{reg.url}/v2/r/blobs/uploads/abc?_state=xyz"})
        if req.method in ("PUT", "DELETE"):
            req.body  # noqa: B018 - read what was sent
            return Reply(201 if req.method == "PUT" else 204)
        return Reply(404)

    with Loopback(answer, methods=METHODS) as reg:
        store = OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True), mount_from=["other/repo", "r"])
        done = store.client.push_blob(DIGEST, len(BLOB), BLOB, what="push it", mount_from=store.mount_from)
        seen = [(r.method, r.path) for r in reg.requests]
    assert store.mount_from == ["other/repo"]  # never from itself
    assert seen[0] == ("HEAD", f"/v2/r/blobs/{DIGEST}")
    assert seen[1] == ("POST", f"/v2/r/blobs/uploads/?mount={DIGEST}&from=other/repo")
    if mount == 201:
        assert done == "mounted" and len(seen) == 2
    else:
        assert done == "uploaded"
        assert seen[2:] == [("DELETE", "/v2/r/blobs/uploads/mounted-session"), ("POST", "/v2/r/blobs/uploads/"),
                            ("PUT", f"/v2/r/blobs/uploads/abc?_state=xyz&digest={DIGEST}")]
        put = next(r for r in reg.requests if r.method == "PUT")
        assert put.body == BLOB and put.headers["content-length"] == str(len(BLOB))


def test_the_tag_list_follows_its_link_pages() -> None:
    def answer(req: Request) -> Reply:
        if req.path.startswith("/v2/r/tags/list?n=1000"):
            return Reply(200, {"Link": '</v2/r/tags/list?n=2&last=b>; rel="next"'}, json.dumps({"tags": ["a", "b"]}).encode())
        if req.path == "/v2/r/tags/list?n=2&last=b":
            return Reply(200, {}, json.dumps({"name": "r", "tags": ["k-" + "ab" * 32]}).encode())
        return Reply(404, {}, errors("MANIFEST_UNKNOWN", "gone"))  # the key tag was deleted meanwhile: left out

    with Loopback(answer) as reg:
        store = OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True))
        assert store.client.tags(what="list") == ["a", "b", "k-" + "ab" * 32]
        assert store.list_entries() == []
        assert f"/v2/r/manifests/k-{'ab' * 32}" in reg.paths()


def test_a_password_never_goes_to_a_plain_http_token_realm() -> None:
    with Loopback(lambda req: Reply(401, {"WWW-Authenticate": 'Bearer realm="http://registry.example.com/token"'})) as reg:
        with pytest.raises(RegistryError) as e:
            OciStore(f"oci://127.0.0.1:{reg.port}/r", user="u", password=PASSWORD, log=Log(quiet=True)).lookup("ab" * 32)
    assert "plain http" in e.value.what and "never sent unencrypted" in e.value.why and PASSWORD not in e.value.render()


def test_a_web_server_that_is_not_a_registry_is_not_an_empty_store() -> None:
    with Loopback(lambda req: Reply(404, {"Content-Type": "text/html"}, b"<h1>Not Found</h1>")) as web:
        with pytest.raises(RegistryError) as e:
            OciStore(f"oci://127.0.0.1:{web.port}/r", log=Log(quiet=True)).lookup("ab" * 32)
        assert web.paths() == [f"/v2/r/manifests/k-{'ab' * 32}", "/v2/"]
    assert "is not an OCI registry" in e.value.what
    with Loopback(lambda req: Reply(200, {}, b"{}") if req.path == "/v2/" else Reply(404)) as reg:
        store = OciStore(f"oci://127.0.0.1:{reg.port}/r", log=Log(quiet=True))
        assert store.lookup("ab" * 32) is None and store.lookup("cd" * 32) is None
        assert reg.paths().count("/v2/") == 1  # asked once


def test_publish_says_when_a_zip_is_not_packed_as_llamabundle_packs(tmp_path: Path) -> None:
    zip_path, m = make_zip(tmp_path)
    redated = tmp_path / "redated.zip"
    with zipfile.ZipFile(zip_path) as zin, zipfile.ZipFile(redated, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            info.date_time = (2001, 2, 3, 4, 5, 6)
            zout.writestr(info, zin.read(info))
    for path, said in ((zip_path, None), (redated, "is dated (2001, 2, 3, 4, 5, 6), not by bundle.json's built_at")):
        log, buf = captured()
        (tmp_path / path.stem).mkdir()
        OciStore("oci://127.0.0.1:9/x", log=log)._prepare(path, m, tmp_path / path.stem)
        if said is None:
            assert buf.getvalue() == ""
        else:
            assert said in buf.getvalue() and "will not rebuild it byte for byte" in buf.getvalue()


def test_a_repository_to_mount_from_that_is_no_repository_name_is_a_usage_error() -> None:
    from llamabundle.errors import UsageError

    with pytest.raises(UsageError, match="'Team/CPU' is not a repository name to mount blobs from"):
        OciStore("oci://127.0.0.1:5000/team/cuda", log=Log(quiet=True), mount_from=["Team/CPU"])
