"""The OCI registry store against a real registry (tests/registry.py: Debian's docker-registry, the CNCF
distribution registry 2.8, behind a loopback proxy that counts blob bytes and can demand bearer tokens), with
real zips and manifests of small bundles (no llama.cpp build): two bundles that share files keep each blob once;
an install downloads only the layers its blob cache lacks; concurrent and killed publishers leave one complete
entry; a tampered blob is refused; the token flow; `fetch` rebuilds the published zip byte for byte; the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from rich.console import Console

from llamabundle import api, bundle
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import StoreError, VerifyError
from llamabundle.log import Log
from llamabundle.runtime.install import BundleInvalid, check_bundle, install_bundle, list_installed
from llamabundle.store import codec
from llamabundle.store.oci import MANIFEST_TYPE, OciStore, RegistryError, key_tag
from llamabundle.store.oci.store import zip_epoch
from tests import bundles as tb
from tests.clibundles import SERVER
from tests.registry import Proxy, Registry, free_port, serve

REPO = Path(__file__).resolve().parents[2]
NAME = "test/bundles"
QUIET = Log(quiet=True)
BUILT_AT = "2025-03-01T12:00:00Z"
PASSWORD = "s3cret-Pa55word-for-the-registry"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with serve(tmp_path / "registry") as reg:
        yield reg


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def url(proxy: Proxy | Registry) -> str:
    return f"oci://{proxy.netloc}/{NAME}"


def shared_bytes() -> bytes:
    rng = random.Random(33)
    return rng.randbytes(900_000) + b"llama vocabulary " * 40_000  # some 1.6 MB, a third of it compressible


def make_bundle(tmp: Path, tag: str, *, own_size: int = 500_000, built_at: str | None = BUILT_AT) -> tuple[Path, Manifest]:
    """A real bundle zip: llama-server (a script), LICENSE (twice: the same content at two paths), a vocabulary
    shared by every bundle and a data file of its own; packed as the pipeline packs (entries dated built_at)."""
    files = {"llama-server": SERVER, "LICENSE": b"MIT License\n", "licenses/LICENSE.txt": b"MIT License\n",
             "models/vocab.bin": shared_bytes(), "data.bin": random.Random(tag).randbytes(own_size)}
    roles = {"llama-server": "exe", "LICENSE": "license", "licenses/LICENSE.txt": "license",
             "models/vocab.bin": "runtime", "data.bin": "runtime"}
    stage = tmp / f"stage-{tag}"
    fields = {"built_at": built_at} if built_at else {}
    tb.write_bundle(stage, files, roles, name=f"oci-{tag}", inputs=tb.inputs_for(f"oci-{tag}"),
                    executables=("llama-server",), **fields)
    m = bundle.read_manifest(stage)
    return bundle.pack(stage, tmp / f"oci-{tag}-{m.key[:12]}.zip", source_date_epoch=zip_epoch(built_at)), m


def layers_of(zip_path: Path, m: Manifest) -> dict[str, int]:
    """The zstd blob of each unique file content, made here from the zip's members: digest -> size."""
    out: dict[str, int] = {}
    with zipfile.ZipFile(zip_path) as z:
        for f in {f.sha256: f for f in m.files}.values():
            buf = io.BytesIO()
            codec.pack(io.BytesIO(z.read(f.path)), buf)
            out[sha(buf.getvalue())] = len(buf.getvalue())
    return out


def manifest_bytes(where: Proxy | Registry, key: str) -> bytes:
    r = requests.get(f"http://{where.netloc}/v2/{NAME}/manifests/{key_tag(key)}", headers={"Accept": MANIFEST_TYPE},
                     timeout=10)
    assert r.status_code == 200, r.text
    return r.content


def cli(*args: object, tmp: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "LLAMABUNDLE_CACHE_DIR": str(tmp / "cache"),
            **(env or {})}
    for k in ("LLAMABUNDLE_STORE", "GITHUB_ACTIONS", "LLAMABUNDLE_REGISTRY_USER", "LLAMABUNDLE_REGISTRY_PASSWORD"):
        if k not in (env or {}):
            full.pop(k, None)
    return subprocess.Popen([sys.executable, "-m", "llamabundle", *map(str, args)], env=full, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def run(*args: object, tmp: Path, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str, str]:
    p = cli(*args, tmp=tmp, env=env)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def captured() -> tuple[Log, io.StringIO]:
    buf = io.StringIO()
    return Log(console=Console(file=buf, width=200, force_terminal=False)), buf


def test_a_publish_into_another_repository_mounts_the_blobs_it_names(registry: Registry, tmp_path: Path) -> None:
    """LLAMABUNDLE_REGISTRY_MOUNT_FROM: `publish` into a second repository of the same registry mounts each blob
    the first holds (POST ?mount=&from=, answered 201 by the distribution registry) instead of uploading it."""
    (za, ma), (zb, mb) = make_bundle(tmp_path, "a"), make_bundle(tmp_path, "b")
    la, lb = layers_of(za, ma), layers_of(zb, mb)
    with Proxy(registry.netloc) as proxy:
        first = f"oci://{proxy.netloc}/team/cpu"
        assert run("publish", za, "--store", first, tmp=tmp_path)[0] == 0
        proxy.reset()
        code, _out, err = run("publish", zb, "--store", f"oci://{proxy.netloc}/team/cuda", tmp=tmp_path,
                              env={"LLAMABUNDLE_REGISTRY_MOUNT_FROM": "team/cpu"})
        assert code == 0, err
        config_b = mb.text().encode()
        new = {d: n for d, n in lb.items() if d not in la}
        assert dict(proxy.put) == {**new, sha(config_b): len(config_b)}  # the shared layers were mounted, not sent
    assert sorted(registry.tags("team/cuda")) == [key_tag(mb.key)]
    got = install_bundle(OciStore(f"oci://{registry.netloc}/team/cuda", log=QUIET), mb.key, root=tmp_path / "data",
                         log=QUIET, platform=mb.platform)
    check_bundle(got.installed.path, key=mb.key, platform=mb.platform)


# ------------------------------------------------------------------------------------------------ 1


def test_two_bundles_that_share_files_keep_each_blob_once(registry: Registry, tmp_path: Path) -> None:
    (za, ma), (zb, mb) = make_bundle(tmp_path, "a"), make_bundle(tmp_path, "b")
    la, lb = layers_of(za, ma), layers_of(zb, mb)
    assert len(la) == len(lb) == 4 and len(la | lb) == 5  # LICENSE twice is one layer; only data.bin differs
    with Proxy(registry.netloc) as proxy:
        store = OciStore(url(proxy), log=QUIET, tags={ma.key: "oci-a-release"})
        first = store.publish(za, ma)
        config_a = ma.text().encode()
        assert first.created and dict(proxy.put) == {**la, sha(config_a): len(config_a)}
        proxy.reset()
        second = store.publish(zb, mb)
        config_b = mb.text().encode()
        new = {d: n for d, n in lb.items() if d not in la}
        assert second.created and dict(proxy.put) == {**new, sha(config_b): len(config_b)}  # the shared ones: HEAD only
        again = store.publish(za, ma)
        assert not again.created and again.entry.location == first.entry.location
        raw_a, raw_b = manifest_bytes(proxy, ma.key), manifest_bytes(proxy, mb.key)
    expected = {**la, **lb, sha(config_a): len(config_a), sha(config_b): len(config_b), sha(raw_a): len(raw_a),
                sha(raw_b): len(raw_b)}
    assert registry.blobs() == expected  # layers once, two configs, two manifests: nothing else
    assert registry.tags(NAME) == sorted([key_tag(ma.key), key_tag(mb.key), "oci-a-release"])
    assert first.entry.location == f"{url(proxy)}@{sha(raw_a)}"
    for raw, m, z in ((raw_a, ma, za), (raw_b, mb, zb)):
        doc = json.loads(raw)
        assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()  # canonical
        assert (doc["mediaType"], doc["artifactType"], doc["config"]["mediaType"]) == (
            MANIFEST_TYPE, "application/vnd.llamabundle.bundle.v1+json", "application/vnd.llamabundle.bundle.v1+json")
        assert doc["annotations"]["dev.llamabundle.zip.sha256"] == hashlib.sha256(z.read_bytes()).hexdigest()
        titles = {la_["annotations"]["org.opencontainers.image.title"]: la_ for la_ in doc["layers"]}
        lic = titles["LICENSE"]["annotations"]
        assert json.loads(lic["dev.llamabundle.file.paths"]) == {"LICENSE": "0644", "licenses/LICENSE.txt": "0644"}
        assert json.loads(titles["llama-server"]["annotations"]["dev.llamabundle.file.paths"]) == {"llama-server": "0755"}
        assert lic["dev.llamabundle.file.sha256"] == next(f.sha256 for f in m.files if f.path == "LICENSE")
    listed = OciStore(url(registry), log=QUIET).list_entries()
    assert [e.key for e in listed] == sorted([ma.key, mb.key])


# ------------------------------------------------------------------------------------------------ 2


def test_a_second_install_downloads_only_the_layers_it_lacks(registry: Registry, tmp_path: Path) -> None:
    (za, ma), (zb, mb) = make_bundle(tmp_path, "a", own_size=700_000), make_bundle(tmp_path, "b", own_size=300_000)
    la, lb = layers_of(za, ma), layers_of(zb, mb)
    root = tmp_path / "data"
    with Proxy(registry.netloc) as proxy:
        OciStore(url(proxy), log=QUIET).publish(za, ma)
        OciStore(url(proxy), log=QUIET).publish(zb, mb)
        proxy.reset()
        first = install_bundle(OciStore(url(proxy), log=QUIET), ma.key, root=root, log=QUIET)
        got_first = {d: n for d, n in proxy.got.items() if d in la}
        assert got_first == la and first.transfer.downloaded == sum(la.values())
        assert (first.transfer.by, first.transfer.fetched) == ("blobs", 4)
        proxy.reset()
        second = api.install(store=url(proxy), key=mb.key, root=root, env={"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "c")})
        new = {d: n for d, n in lb.items() if d not in la}
        config_b = sha(mb.text().encode())
        assert set(proxy.got) == {*new, config_b}  # the new layer and the bundle.json, nothing shared
        assert {d: n for d, n in proxy.got.items() if d != config_b} == new
        assert (second.transfer, second.downloaded_bytes) == ("blobs", sum(new.values()))
        print(f"\nsecond install: {sum(new.values())} bytes of layers at the proxy "
              f"(whole bundle's layers: {sum(lb.values())}; zip: {zb.stat().st_size})")
    for m in (ma, mb):
        inst = next(i for i in list_installed(root) if i.key == m.key)
        check_bundle(inst.path, key=m.key, platform="linux-x86_64")
        assert (inst.path / "llama-server").stat().st_mode & 0o777 == 0o755
        assert (inst.path / "models" / "vocab.bin").read_bytes() == shared_bytes()


# ------------------------------------------------------------------------------------------------ 3


def test_four_concurrent_publisher_processes_leave_one_complete_entry(registry: Registry, tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "race", own_size=2_000_000)
    with Proxy(registry.netloc) as proxy:
        procs = [cli("publish", z, "--store", url(proxy), "--json", tmp=tmp_path / f"p{i}") for i in range(4)]
        done = [p.communicate(timeout=180) for p in procs]
        for p, (_out, err) in zip(procs, done, strict=True):
            assert p.returncode == 0, err
        results = [json.loads(out) for out, _err in done]
        assert {r["key"] for r in results} == {m.key}
        assert len({r["location"] for r in results}) == 1  # byte-identical manifests: one digest
        assert registry.tags(NAME) == [key_tag(m.key)]
        entry = OciStore(url(proxy), log=QUIET).lookup(m.key)
        assert entry is not None and entry.location == results[0]["location"]
        assert set(layers_of(z, m)) <= set(registry.blobs())
        inst = install_bundle(OciStore(url(proxy), log=QUIET), m.key, root=tmp_path / "data", log=QUIET).installed
        check_bundle(inst.path, key=m.key, platform="linux-x86_64")


# ------------------------------------------------------------------------------------------------ 4


def test_a_publisher_killed_mid_upload_leaves_no_entry_and_the_next_run_completes(registry: Registry,
                                                                                   tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "kill", own_size=3_000_000)
    with Proxy(registry.netloc) as proxy:
        proxy.stall_put_after = 512 << 10  # the big blob's PUT stops there: the publisher is inside its upload
        victim = cli("publish", z, "--store", url(proxy), tmp=tmp_path)
        try:
            assert proxy.stalled.wait(60), "no blob PUT reached the proxy"
        finally:
            os.kill(victim.pid, signal.SIGKILL)
            victim.communicate(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        proxy.stall_put_after = None
        proxy.release.set()
        assert OciStore(url(proxy), log=QUIET).lookup(m.key) is None  # no tag: not an entry
        code, out, err = run("publish", z, "--store", url(proxy), "--json", tmp=tmp_path)
        assert code == 0, err
        assert json.loads(out)["created"] is True
        got = install_bundle(OciStore(url(proxy), log=QUIET), m.key, root=tmp_path / "data", log=QUIET)
        check_bundle(got.installed.path, key=m.key, platform="linux-x86_64")
    leftovers = list(Path(tempfile.gettempdir()).glob(f"llamabundle-oci-publish-{victim.pid}-*"))
    assert leftovers == []  # the killed publisher's compressed blobs were swept by the next publish


# ------------------------------------------------------------------------------------------------ 5


@pytest.mark.parametrize("how", ["other-frame", "same-size"])
def test_a_tampered_blob_is_refused_and_nothing_is_installed(registry: Registry, tmp_path: Path, how: str) -> None:
    z, m = make_bundle(tmp_path, "tamper")
    with Proxy(registry.netloc) as proxy:
        OciStore(url(proxy), log=QUIET).publish(z, m)
    doc = json.loads(manifest_bytes(registry, m.key))
    digest = next(la["digest"] for la in doc["layers"] if la["annotations"]["org.opencontainers.image.title"] == "data.bin")
    stored = registry.blob_files()[digest]
    if how == "other-frame":  # a good zstd frame of other bytes
        buf = io.BytesIO()
        codec.pack(io.BytesIO(b"not the data\n" * 1000), buf)
        stored.write_bytes(buf.getvalue())
    else:  # the same length, a few bytes changed in the middle
        raw = bytearray(stored.read_bytes())
        raw[len(raw) // 2:len(raw) // 2 + 8] = bytes(b ^ 0xFF for b in raw[len(raw) // 2:len(raw) // 2 + 8])
        stored.write_bytes(bytes(raw))
    root = tmp_path / "data"
    with pytest.raises(BundleInvalid) as e:
        install_bundle(OciStore(url(registry), log=QUIET), m.key, root=root, log=QUIET)
    assert "data.bin" in e.value.what and "bundle_invalid" in e.value.what and e.value.exit_code == 5
    assert list_installed(root) == []
    slot = root / "bundles" / m.name
    assert not slot.exists() or sorted(p.name for p in slot.iterdir()) == []  # no version directory, no pointer
    code, out, err = run("install", "--store", url(registry), "--key", m.key, "--dest", root, "--json", tmp=tmp_path)
    assert code == 5, err
    failure = json.loads(out)["error"]
    assert failure["exit_code"] == 5 and "data.bin" in failure["what"] and "bundle_invalid" in failure["what"]
    assert "Traceback" not in err and list_installed(root) == []


# ------------------------------------------------------------------------------------------------ 6


def test_the_bearer_token_flow_and_no_secret_in_any_output(registry: Registry, tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "auth")
    with Proxy(registry.netloc, auth=("ci-user", PASSWORD)) as proxy:
        log, buf = captured()
        good = OciStore(url(proxy), user="ci-user", password=PASSWORD, log=log)
        assert good.publish(z, m).created
        got = install_bundle(OciStore(url(proxy), user="ci-user", password=PASSWORD, log=log), m.key,
                             root=tmp_path / "data", log=log)
        check_bundle(got.installed.path, key=m.key, platform="linux-x86_64")
        assert proxy.tokens and all(a.startswith("Basic ") for a in proxy.token_requests)
        assert len(proxy.token_requests) <= 4  # one token per scope (pull; pull,push) per store object, reused

        texts = [buf.getvalue()]
        for user, password, said in (("ci-user", "wrong-" + PASSWORD, "refused the credentials"),
                                     (None, None, "gave no anonymous token")):
            log, buf = captured()
            with pytest.raises(RegistryError) as e:
                OciStore(url(proxy), user=user, password=password, log=log).lookup(m.key)
            text = e.value.render()
            assert proxy.netloc in text and "UNAUTHORIZED" in text and said in text, text
            assert e.value.exit_code == 6
            texts += [text, buf.getvalue()]
        env = {"LLAMABUNDLE_REGISTRY_USER": "ci-user", "LLAMABUNDLE_REGISTRY_PASSWORD": "wrong-" + PASSWORD}
        code, out, err = run("install", "--store", url(proxy), "--key", m.key, "--dest", tmp_path / "d2", "--json",
                             tmp=tmp_path, env=env)
        assert code == 6 and "UNAUTHORIZED" in err and proxy.netloc in err and "Traceback" not in err
        texts += [out, err]
        env["LLAMABUNDLE_REGISTRY_PASSWORD"] = PASSWORD
        code, out, err = run("install", "--store", url(proxy), "--key", m.key, "--dest", tmp_path / "d3", "--json",
                             tmp=tmp_path, env=env)
        assert code == 0, err
        texts += [out, err]
        secrets = [PASSWORD, *proxy.tokens]
    for text in texts:
        for s in secrets:
            assert s not in text


# ------------------------------------------------------------------------------------------------ 7


@pytest.mark.parametrize("built_at", [BUILT_AT, None])
def test_fetch_rebuilds_the_published_zip_byte_for_byte(registry: Registry, tmp_path: Path, built_at: str | None) -> None:
    z, m = make_bundle(tmp_path, "fetch", built_at=built_at)
    OciStore(url(registry), log=QUIET).publish(z, m)
    store = OciStore(url(registry), log=QUIET)
    entry = store.lookup(m.key)
    assert entry is not None and (entry.zip_name, entry.zip_size) == (z.name, z.stat().st_size)

    class Sink:
        def __init__(self) -> None:
            self.data = bytearray()

        def update(self, data: bytes) -> None:
            self.data += data

        def reset(self) -> None:
            self.data.clear()

    sink = Sink()
    out = store.fetch(entry, tmp_path / "fetched", sink=sink)
    assert out == tmp_path / "fetched" / z.name
    assert out.read_bytes() == z.read_bytes() == bytes(sink.data)
    assert sorted(p.name for p in out.parent.iterdir()) == [z.name]  # nothing of the rebuild left beside it
    code, _out, err = run("fetch", m.key, "--store", url(registry), "--out", tmp_path / "unpacked", tmp=tmp_path)
    assert code == 0, err
    assert (tmp_path / "unpacked" / "models" / "vocab.bin").read_bytes() == shared_bytes()


def test_an_entry_is_pinned_to_the_digest_its_lookup_read(registry: Registry, tmp_path: Path) -> None:
    """The key tag moves after a lookup (another manifest of the key: here the same files under another zip
    name): the entry's files and zip still come from the manifest the lookup read, pulled by digest."""
    z, m = make_bundle(tmp_path, "pinned")
    with Proxy(registry.netloc) as proxy:
        OciStore(url(proxy), log=QUIET).publish(z, m)
        entry = OciStore(url(proxy), log=QUIET).lookup(m.key)
        assert entry is not None
        doc = json.loads(manifest_bytes(proxy, m.key))
        doc["annotations"]["dev.llamabundle.zip.name"] = "moved.zip"
        moved = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        r = requests.put(f"http://{proxy.netloc}/v2/{NAME}/manifests/{key_tag(m.key)}", data=moved,
                         headers={"Content-Type": MANIFEST_TYPE}, timeout=10)
        assert r.status_code == 201, r.text
        now = OciStore(url(proxy), log=QUIET).lookup(m.key)
        assert now is not None and now.zip_name == "moved.zip" and now.location == f"{url(proxy)}@{sha(moved)}"
        proxy.reset()
        out = OciStore(url(proxy), log=QUIET).fetch(entry, tmp_path / "fetched")  # a store that never saw it
        assert out.read_bytes() == z.read_bytes()
        assert not [path for _m, path, _s, _a in proxy.seen if "/manifests/k-" in path]  # never the tag
        assert (f"/v2/{NAME}/manifests/{entry.location.rpartition('@')[2]}" in
                [path for _m, path, _s, _a in proxy.seen])


def test_a_zip_that_cannot_be_rebuilt_is_said_so(registry: Registry, tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "odd")
    odd = tmp_path / "odd.zip"
    with zipfile.ZipFile(z) as zin, zipfile.ZipFile(odd, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info), compresslevel=1)  # another deflate than pack's
    log, buf = captured()
    OciStore(url(registry), log=log).publish(odd, m)
    assert "will not rebuild it byte for byte" not in buf.getvalue()  # its directory is pack's; only deflate differs
    store = OciStore(url(registry), log=QUIET)
    entry = store.lookup(m.key)
    assert entry is not None
    with pytest.raises(VerifyError) as e:
        store.fetch(entry, tmp_path / "fetched")
    assert "differs from the published odd.zip" in e.value.what and "zlib" in e.value.why
    assert not (tmp_path / "fetched" / "odd.zip").exists()


# ------------------------------------------------------------------------------------------------ 8


def test_the_cli_installs_from_an_oci_store_and_indexes_it(registry: Registry, tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "cli")
    code, out, err = run("publish", z, "--store", url(registry), "--json", tmp=tmp_path)
    assert code == 0, err
    assert json.loads(out)["location"].startswith(f"{url(registry)}@sha256:")
    code, out, err = run("install", "--store", url(registry), "--key", m.key, "--dest", tmp_path / "data", "--json",
                         tmp=tmp_path)
    assert code == 0, err
    got = json.loads(out)
    assert got["key"] == m.key and got["transfer"]["by"] == "blobs"
    check_bundle(Path(got["path"]), key=m.key, platform="linux-x86_64")
    code, out, err = run("check", REPO / "recipes" / "linux-x86_64-cpu.yaml", "--store", url(registry), tmp=tmp_path)
    assert code == 1 and out.startswith("miss")  # another key: a miss, not an error
    code, out, err = run("index", "--store", url(registry), "--out", tmp_path / "site", "--json", tmp=tmp_path)
    assert code == 0, err
    site = json.loads((tmp_path / "site" / "index.json").read_text())
    assert [r["key"] for r in site["bundles"]] == [m.key]


def test_errors_are_messages_not_tracebacks(registry: Registry, tmp_path: Path) -> None:
    z, m = make_bundle(tmp_path, "errors")
    dead = Registry(tmp_path / "dead")  # a port where nothing listens
    dead.port = free_port()
    with pytest.raises(StoreError) as e:
        OciStore(url(dead), log=QUIET, max_attempts=1).lookup(m.key)
    assert "connection refused" in e.value.why and "unreachable" in e.value.what
    with pytest.raises(RegistryError) as e:
        OciStore(f"oci://{registry.netloc}/never/published", log=QUIET).list_entries()
    assert "NAME_UNKNOWN" in e.value.why and e.value.exit_code == 6
    code, _out, err = run("install", "--store", f"oci://{registry.netloc}/Upper/Case", "--key", m.key, tmp=tmp_path)
    assert code == 2 and "lower case" in err and "Traceback" not in err
    start = time.monotonic()
    code, _out, err = run("check", REPO / "recipes" / "linux-x86_64-cpu.yaml", "--store", url(dead), tmp=tmp_path)
    assert code == 6 and "connection refused" in err and "Traceback" not in err and time.monotonic() - start < 60
