"""One typed manifest and one trust check (DESIGN §5, issue 12): wrong types name their field (exit 5), and a
bundle whose key is not its own, or not the hash of its inputs, is refused wherever it is used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llamabundle import backends, bundle
from llamabundle.bundle import manifest
from llamabundle.bundle.manifest import Expect, ManifestError
from tests.bundles import COMMIT, inputs_for, key_of, make_zip, write_bundle

FILES = {"LICENSE": b"MIT License\n", "libggml-base.so": b"base" * 100}
ROLES = {"LICENSE": "license", "libggml-base.so": "runtime"}


def good(tmp: Path) -> dict[str, Any]:
    return write_bundle(tmp / "b", FILES, ROLES, name="t", inputs=inputs_for("m"))


def with_(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of data with the dotted/indexed `path` set to value (`files.0.size`)."""
    out = json.loads(json.dumps(data))
    cur: Any = out
    *parents, last = path.split(".")
    for p in parents:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    if isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value
    return out


@pytest.mark.parametrize(("path", "value", "field", "what"), [
    ("files", "x", "files", "is the string 'x', not a list"),
    ("files.0", 1, "files[0]", "is a number, not an object"),
    ("files.0.size", "12", "files[0].size", "is the string '12', not a size in bytes"),
    ("files.0.size", -1, "files[0].size", "is a number, not a size in bytes"),
    ("files.0.size", True, "files[0].size", "is a boolean, not a size in bytes"),
    ("files.0.sha256", "ab", "files[0].sha256", "is 'ab', not 64 lowercase hex digits"),
    ("files.0.role", "tool", "files[0].role", "is 'tool', not one of exe, backend, runtime, license"),
    ("platform", 5, "platform", "is a number, not a string"),
    ("key", 12345, "key", "is a number, not a string"),
    ("key", "f" * 63, "key", f"is {'f' * 63!r}, not 64 lowercase hex digits"),
    ("llama_cpp", "x", "llama_cpp", "is the string 'x', not an object"),
    ("llama_cpp.commit", "abc", "llama_cpp.commit", "is 'abc', not a 40-digit commit"),
    ("inputs", [1], "inputs", "is a list, not an object"),
    ("name", "../x", "name", "is '../x', not a bundle name"),
    ("backends", "cpu", "backends", "is the string 'cpu', not a list"),
    ("cuda", {"toolkit": 12, "archs": {}}, "cuda.toolkit", "is a number, not a string"),
    ("cuda", {"toolkit": "12.8.1", "archs": {"sass": "86"}}, "cuda.archs.sass", "is the string '86', not a list"),
    ("publish", {"tag": 3}, "publish.tag", "is a number, not a string"),
])
def test_a_wrong_type_is_a_verification_error_naming_the_field(tmp_path: Path, path: str, value: Any, field: str,
                                                               what: str) -> None:
    with pytest.raises(ManifestError) as e:  # parsed, and each backend's section read typed, as trust paths do
        backends.read_sections(manifest.parse(with_(good(tmp_path), path, value)))
    assert e.value.exit_code == 5
    assert e.value.field == field
    assert e.value.what == f"bundle.json: '{field}' {what}"


@pytest.mark.parametrize("data", [[1, 2], "x", 3, None])
def test_a_manifest_that_is_not_an_object_is_refused(data: Any) -> None:
    with pytest.raises(ManifestError, match="not an object") as e:
        manifest.parse(data)
    assert e.value.exit_code == 5


def test_missing_fields_duplicates_and_unknown_platforms_are_refused(tmp_path: Path) -> None:
    data = good(tmp_path)
    for k in ("name", "key", "inputs", "llama_cpp", "platform", "files"):
        d = dict(data)
        del d[k]
        with pytest.raises(ManifestError, match=f"lacks '{k}'"):
            manifest.parse(d)
    twice = with_(data, "files", data["files"] + [data["files"][0]])
    with pytest.raises(ManifestError, match=r"'files\[2\].path' lists 'LICENSE' twice"):
        manifest.parse(twice)
    with pytest.raises(ManifestError, match="'platform' is 'macos-arm64', which this llamabundle does not know"):
        manifest.parse(with_(data, "platform", "macos-arm64"))


def test_loads_refuses_bytes_that_are_not_utf8_json_and_names_where(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="^bundle.json of release x is not UTF-8 text$"):
        manifest.loads(b"\xff\xfe{}", where="bundle.json of release x")
    with pytest.raises(ManifestError, match="^STORE/k/bundle.json is not valid JSON$"):
        manifest.loads(b"{", where="STORE/k/bundle.json")
    with pytest.raises(ManifestError, match=r"^STORE/k/bundle.json: 'files' is a number, not a list$"):
        manifest.loads(json.dumps(with_(good(tmp_path), "files", 3)).encode(), where="STORE/k/bundle.json")


def test_the_typed_manifest_round_trips_and_keeps_unknown_fields(tmp_path: Path) -> None:
    data = with_(good(tmp_path), "future_field", {"a": [1, 2]})
    m = manifest.parse(data)
    assert m.to_json() == data
    assert m.to_json() is not m.to_json()  # a copy each time: the manifest cannot be changed through it
    assert m.key == key_of(inputs_for("m")) == m.inputs_key()
    assert [f.path for f in m.files] == ["LICENSE", "libggml-base.so"]
    assert m.file("LICENSE") is not None and m.file("LICENSE").size == 12  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        m.inputs["platform"] = "windows-x86_64"  # type: ignore[index]
    assert json.loads(m.text()) == data


# ------------------------------------------------------------------------------------ the trust check


def test_trust_passes_an_intact_bundle_and_what_was_asked_for(tmp_path: Path) -> None:
    good(tmp_path)
    m = bundle.read_manifest(tmp_path / "b")
    check = manifest.trust(m, tmp_path / "b", Expect(key=m.key, platform="linux-x86_64", commit=COMMIT))
    assert check is not None and (check.files, check.bytes) == (2, 12 + 400)


@pytest.mark.parametrize(("change", "expect", "message"), [
    ({"key": "f" * 64}, Expect(), "is not the sha256 of the inputs its bundle.json records"),
    ({"inputs": {**inputs_for("m"), "recipe": "other"}}, Expect(), "is not the sha256 of the inputs"),
    ({"platform": "windows-x86_64"}, Expect(), "it says platform windows-x86_64, its inputs say linux-x86_64"),
    ({"llama_cpp": {"commit": "1" * 40}}, Expect(), "it says llama.cpp 111111111111, its inputs say 0c1e57098bba"),
    ({"cuda": {"toolkit": "12.8.1", "archs": {}}}, Expect(), "it says CUDA 12.8.1, its inputs say none"),
    ({}, Expect(key="e" * 64), "names key"),
    ({}, Expect(platform="windows-x86_64"), "it is built for linux-x86_64, not windows-x86_64"),
    ({}, Expect(commit="2" * 40), "expected 2222222222222222222222222222222222222222"),
    ({}, Expect(toolkits={"cuda": "12.8.1"}), "it was built without CUDA, expected CUDA 12.8.1"),
])
def test_trust_refuses_a_rekeyed_edited_or_unasked_for_bundle(tmp_path: Path, change: dict[str, Any], expect: Expect,
                                                              message: str) -> None:
    m = manifest.parse({**good(tmp_path), **change})
    with pytest.raises(ManifestError) as e:
        manifest.trust(m, tmp_path / "b", expect)
    assert e.value.exit_code == 5
    assert message in e.value.what and e.value.what.startswith(f"bundle {m.key[:12]} refused: ")


def test_a_windows_manifest_under_a_linux_key_is_refused(tmp_path: Path) -> None:
    linux = inputs_for("same")
    win = write_bundle(tmp_path / "w", FILES, ROLES, name="t", inputs=inputs_for("same", platform="windows-x86_64"))
    m = manifest.parse(win)
    with pytest.raises(ManifestError, match="names key"):
        manifest.check_consistent(m, Expect(key=key_of(linux)))
    forged = manifest.parse({**win, "key": key_of(linux)})  # claims the Linux key outright
    with pytest.raises(ManifestError, match="is not the sha256 of the inputs"):
        manifest.check_consistent(forged, Expect(key=key_of(linux)))


def test_verify_refuses_a_rekeyed_real_zip_and_names_the_zip(tmp_path: Path) -> None:
    """The CLI's verify (a real process): a zip whose bundle.json key was rewritten to 64 × f is exit 5."""
    zip_path, data = make_zip(tmp_path, FILES, ROLES, name="t", inputs=inputs_for("v"))
    stage = next(tmp_path.glob("stage-*"))
    (stage / "bundle.json").write_text(json.dumps({**data, "key": "f" * 64}, indent=2, sort_keys=True) + "\n")
    bundle.pack(stage, zip_path, source_date_epoch=0)
    r = subprocess.run([sys.executable, "-m", "llamabundle", "verify", str(zip_path)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 5, r.stderr
    assert "is not the sha256 of the inputs" in r.stderr and "Traceback" not in r.stderr
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # the verify copy is gone


# -------------------------------------------------------------------------------- JSON schema

BUNDLE_SCHEMA = Path(manifest.__file__).resolve().parents[1] / "data" / "schemas" / "bundle.schema.json"
REGENERATE_BUNDLE = ("llamabundle/data/schemas/bundle.schema.json is out of date; regenerate it with:\n"
                     "  python3 -c 'import json; from llamabundle.backends import bundle_schema; "
                     "open(\"llamabundle/data/schemas/bundle.schema.json\", \"w\").write(json.dumps(bundle_schema(), indent=2, "
                     "sort_keys=True) + \"\\n\")'")


def test_bundle_schema_file_is_current_and_valid() -> None:
    import jsonschema

    committed = BUNDLE_SCHEMA.read_text(encoding="utf-8")
    assert committed == json.dumps(backends.bundle_schema(), indent=2, sort_keys=True) + "\n", REGENERATE_BUNDLE
    jsonschema.Draft202012Validator.check_schema(json.loads(committed))


def test_a_written_manifest_validates_and_what_parse_refuses_the_schema_refuses(tmp_path: Path) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(BUNDLE_SCHEMA.read_text(encoding="utf-8")))
    good = write_bundle(tmp_path / "b", {"LICENSE": b"MIT\n", "llama-server": b"\x7fELF"},
                        {"LICENSE": "license", "llama-server": "exe"}, backends=["cpu"],
                        cuda={"toolkit": "12.8.1", "archs": {"sass": ["86"], "ptx": []}, "driver_floor": "572.61"})
    validator.validate(good)
    for change in ({"format": 2}, {"key": "ABC"}, {"platform": "plan9-mips"},
                   {"files": [{**good["files"][0], "role": "tool"}]}, {"files": [{**good["files"][0], "size": -1}]},
                   {"llama_cpp": {"commit": "0c1e"}}):
        bad = {**good, **change}
        assert list(validator.iter_errors(bad)), change
        with pytest.raises(ManifestError):
            manifest.parse(bad)
