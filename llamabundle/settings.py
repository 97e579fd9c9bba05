"""Run-time settings: the one module that reads environment values into frozen ``Settings`` (the variables
and their fields are listed on the class). The CLI snapshots ``os.environ`` once and calls
``Settings.from_env`` with it; everything downstream gets the values and never looks at ``os.environ``
itself. A bad number is a UsageError naming the variable (exit 2), never a traceback. Not settings: the
environment of child processes (PATH, CUDA_PATH, the MSVC developer variables, …) is the CLI's snapshot,
passed down as an ``env`` mapping to the code that runs or finds programs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .errors import UsageError

DEFAULT_GITHUB_ARCHIVE_URL = "https://codeload.github.com"
DEFAULT_GITHUB_API_URL = "https://api.github.com"
DEFAULT_CUDA_REDIST_URL = "https://developer.download.nvidia.com/compute/cuda/redist"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_BUILD_TIMEOUT = 6 * 3600.0
DEFAULT_CACHE_MAX = 50 << 30
COMPILER_CACHES = ("auto", "sccache", "ccache", "none")  # the settings of a build's compiler cache (compiler_cache.py)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int | None:
    """Bytes from "123", "500M", "50G", "1.5T" (None: "off"); ValueError for anything else."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t in ("OFF", "NONE"):
        return None
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    value = float(t[: len(t) - len(unit)])
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return int(value * _UNITS[unit])
ZIP_EPOCH_FIRST, ZIP_EPOCH_LAST = 315532800, 4354819199  # 1980-01-01 and 2107-12-31T23:59:59Z: a zip's dates

_N = TypeVar("_N", int, float)


def default_data_dir() -> Path:
    """The install root without LLAMABUNDLE_DATA_DIR: the platform's user data directory."""
    import platformdirs

    return Path(platformdirs.user_data_dir("llamabundle", appauthor=False)).expanduser().resolve()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Run-time settings from the environment, read once by the CLI.

    Variables read here (field in brackets):

    LLAMABUNDLE_CACHE_DIR           [cache_dir] cache root: sources, downloads, build trees, toolkits, out/, the
                                    default store (default: the platform's user cache dir)
    LLAMABUNDLE_DATA_DIR            [data_dir_set; data_dir] install root of `install`, `list`, `uninstall`, `probe`, `doctor`
                                    (default: the platform's user data dir)
    LLAMABUNDLE_STORE               [store] the default store when no --store is given (else <cache>/store)
    LLAMABUNDLE_DEBUG               [debug] "1": print the traceback of a failure, as --debug does
    LLAMABUNDLE_GITHUB_ARCHIVE_URL  [github_archive_url] base URL of the `github:` source's archive endpoint
    LLAMABUNDLE_GITHUB_API_URL      [github_api_url] API base of the `github:` store; before GITHUB_API_URL
    GITHUB_API_URL                  [github_api_url] set by Actions runners (GHES: https://HOST/api/v3)
    GITHUB_TOKEN, GH_TOKEN          [github_token] the `github:` store's token, GITHUB_TOKEN first (never printed)
    LLAMABUNDLE_REGISTRY_USER       [registry_user] user name for an `oci://` store's registry (default: none;
                                    with a password but no user, "llamabundle")
    LLAMABUNDLE_REGISTRY_PASSWORD   [registry_password] password or token for an `oci://` store's registry (never
                                    printed; for ghcr.io GITHUB_TOKEN / GH_TOKEN when unset)
    LLAMABUNDLE_REGISTRY_INSECURE   [registry_insecure] "1": plain http to any `oci://` registry (default: https,
                                    but http to 127.0.0.1, ::1 and localhost)
    LLAMABUNDLE_REGISTRY_MOUNT_FROM [registry_mount_from] comma-separated repositories of the same registry that
                                    publish may mount a blob from instead of uploading it (cross-repository mount)
    LLAMABUNDLE_PIP_INDEX_URL       [pip_index_url] index of the `pypi:` source and the PyPI toolkit wheels
    LLAMABUNDLE_CUDA_REDIST_URL     [cuda_redist_url] mirror of NVIDIA's CUDA redist tree
    LLAMABUNDLE_CUDA_INSTALLER      [cuda_installer] a local copy of NVIDIA's Windows installer for
                                    `cuda.source: installer`, instead of the pinned URL
    LLAMABUNDLE_CUDA_INSTALLER_SHA256 [cuda_installer_sha256] its sha256, needed when the version has no pin
    LLAMABUNDLE_CONNECT_TIMEOUT     [connect_timeout] seconds to wait for a connection (> 0, default 10)
    LLAMABUNDLE_BUILD_TIMEOUT       [build_timeout] seconds one cmake configure or build may run (> 0,
                                    default 21600)
    LLAMABUNDLE_COMPILER_CACHE      [compiler_cache] the compiler cache a build compiles through: auto (ccache, else
                                    sccache, when on PATH; the default), ccache, sccache or none; `build
                                    --compiler-cache` before it
    LLAMABUNDLE_CACHE_MAX           [cache_max] the cache's bound: bytes, or with K, M, G or T (default 50G;
                                    "off": none); build and fetch then prune the least recently used
    SOURCE_DATE_EPOCH               [source_date_epoch] timestamp of built_at and the zip's entries, 1980-01-01
                                    to 2107-12-31 (what a zip can date; default: the pinned commit's date)
    GITHUB_ACTIONS                  [github_actions] "true": groups, annotations, step outputs and summary
    GITHUB_OUTPUT                   [github_output] step outputs file (only under GITHUB_ACTIONS=true)
    GITHUB_STEP_SUMMARY             [github_step_summary] step summary file (only under GITHUB_ACTIONS=true)
    GITHUB_WORKSPACE                [github_workspace] the checkout: annotation paths are made relative to it
    """

    cache_dir: Path
    data_dir_set: Path | None = None  # $LLAMABUNDLE_DATA_DIR; None: the platform's user data directory (data_dir)
    store: str | None = None  # $LLAMABUNDLE_STORE: the default store URL
    debug: bool = False  # $LLAMABUNDLE_DEBUG=1
    github_archive_url: str = DEFAULT_GITHUB_ARCHIVE_URL
    github_api_url: str = DEFAULT_GITHUB_API_URL
    github_token: str | None = None
    registry_user: str | None = None  # $LLAMABUNDLE_REGISTRY_USER: an oci:// store's registry user
    registry_password: str | None = None  # $LLAMABUNDLE_REGISTRY_PASSWORD (never printed)
    registry_insecure: bool = False  # $LLAMABUNDLE_REGISTRY_INSECURE=1: plain http to any registry
    registry_mount_from: tuple[str, ...] = ()  # $LLAMABUNDLE_REGISTRY_MOUNT_FROM: repositories to mount blobs from
    pip_index_url: str | None = None
    source_date_epoch: int | None = None
    github_actions: bool = False
    github_output: Path | None = None  # $GITHUB_OUTPUT: key=value lines for later steps
    github_step_summary: Path | None = None  # $GITHUB_STEP_SUMMARY: markdown shown on the run's page
    github_workspace: Path | None = None  # $GITHUB_WORKSPACE: the checkout, for annotation paths
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    cuda_redist_url: str = DEFAULT_CUDA_REDIST_URL
    cuda_installer: Path | None = None  # $LLAMABUNDLE_CUDA_INSTALLER: a local copy of the Windows installer
    cuda_installer_sha256: str | None = None  # $LLAMABUNDLE_CUDA_INSTALLER_SHA256
    build_timeout: float = DEFAULT_BUILD_TIMEOUT  # seconds one cmake configure or build may run before it is stopped
    cache_max: int | None = DEFAULT_CACHE_MAX  # bytes the cache may hold (None: no bound)
    compiler_cache: str = "auto"  # $LLAMABUNDLE_COMPILER_CACHE (COMPILER_CACHES)

    @staticmethod
    def reporting(env: Mapping[str, str]) -> tuple[bool, Path | None, bool]:
        """(github_actions, github_workspace, debug): how a failure is reported, read from the variables that
        cannot be wrong, so that even a bad value of another one (from_env's UsageError) is reported as every
        failure is (a GitHub Actions annotation under GITHUB_ACTIONS=true). As from_env reads them."""
        workspace = env.get("GITHUB_WORKSPACE")
        return env.get("GITHUB_ACTIONS") == "true", Path(workspace) if workspace else None, env.get("LLAMABUNDLE_DEBUG") == "1"

    @property
    def data_dir(self) -> Path:
        """The install root: $LLAMABUNDLE_DATA_DIR, else the platform's user data directory (platformdirs, loaded
        only by a command that installs or reads installs: a fetch or a build hit never does)."""
        return self.data_dir_set if self.data_dir_set is not None else default_data_dir()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        def number(name: str, kind: Callable[[str], _N], default: _N | None, ok: Callable[[_N], bool],
                   wanted: str) -> _N | None:
            """The variable's value as a number; a bad one is a usage error naming it (never a traceback)."""
            raw = (env.get(name) or "").strip()
            if not raw:
                return default
            try:
                value: _N | None = kind(raw)
            except ValueError:
                value = None
            if value is None or not ok(value):
                raise UsageError(f"{name}={env.get(name)!r} is not {wanted}",
                                 why=f"{name} is read from the environment", fix=f"set {name} to {wanted}, or unset it")
            return value

        def seconds(name: str, default: float, wanted: str) -> float:
            value = number(name, float, default, lambda v: 0 < v < float("inf"), wanted)
            assert value is not None
            return value

        def cache_max(raw: str | None) -> int | None:
            if raw is None or not raw.strip():
                return DEFAULT_CACHE_MAX
            try:
                return parse_size(raw)
            except ValueError:
                wanted = "a size in bytes, or with K, M, G or T (e.g. 50G), or off"
                raise UsageError(f"LLAMABUNDLE_CACHE_MAX={raw!r} is not {wanted}", why="LLAMABUNDLE_CACHE_MAX is read from the environment",
                                 fix=f"set LLAMABUNDLE_CACHE_MAX to {wanted}, or unset it") from None

        def compiler_cache(raw: str | None) -> str:
            value = (raw or "").strip().lower() or "auto"
            if value not in COMPILER_CACHES:
                raise UsageError(f"LLAMABUNDLE_COMPILER_CACHE={raw!r} is not one of {', '.join(COMPILER_CACHES)}",
                                 why="LLAMABUNDLE_COMPILER_CACHE is read from the environment",
                                 fix=f"set it to one of {', '.join(COMPILER_CACHES)}, or unset it (auto)")
            return value

        cache = env.get("LLAMABUNDLE_CACHE_DIR")
        if not cache:  # platformdirs only for the default (a CI job or an app sets the directory)
            import platformdirs

            cache = platformdirs.user_cache_dir("llamabundle", appauthor=False)
        data = env.get("LLAMABUNDLE_DATA_DIR")
        sde = number("SOURCE_DATE_EPOCH", int, None, lambda v: ZIP_EPOCH_FIRST <= v <= ZIP_EPOCH_LAST,
                     f"a Unix timestamp from {ZIP_EPOCH_FIRST} (1980-01-01) to {ZIP_EPOCH_LAST} (2107-12-31), "
                     "the dates a zip can hold")
        actions, workspace_path, debug = cls.reporting(env)
        installer = env.get("LLAMABUNDLE_CUDA_INSTALLER")
        return cls(
            cache_dir=Path(cache).expanduser().resolve(),
            data_dir_set=Path(data).expanduser().resolve() if data else None,
            store=env.get("LLAMABUNDLE_STORE") or None,
            debug=debug,
            github_archive_url=env.get("LLAMABUNDLE_GITHUB_ARCHIVE_URL", DEFAULT_GITHUB_ARCHIVE_URL).rstrip("/"),
            # GITHUB_API_URL: set by GitHub Actions runners (GitHub Enterprise Server: https://HOST/api/v3)
            github_api_url=(env.get("LLAMABUNDLE_GITHUB_API_URL") or env.get("GITHUB_API_URL")
                            or DEFAULT_GITHUB_API_URL).rstrip("/"),
            github_token=env.get("GITHUB_TOKEN") or env.get("GH_TOKEN") or None,
            registry_user=env.get("LLAMABUNDLE_REGISTRY_USER") or None,
            registry_password=env.get("LLAMABUNDLE_REGISTRY_PASSWORD") or None,
            registry_insecure=env.get("LLAMABUNDLE_REGISTRY_INSECURE") == "1",
            registry_mount_from=tuple(r.strip() for r in env.get("LLAMABUNDLE_REGISTRY_MOUNT_FROM", "").split(",")
                                      if r.strip()),
            pip_index_url=env.get("LLAMABUNDLE_PIP_INDEX_URL") or None,
            source_date_epoch=sde,
            github_actions=actions,
            github_output=Path(env["GITHUB_OUTPUT"]) if actions and env.get("GITHUB_OUTPUT") else None,
            github_step_summary=Path(env["GITHUB_STEP_SUMMARY"]) if actions and env.get("GITHUB_STEP_SUMMARY") else None,
            github_workspace=workspace_path,
            connect_timeout=seconds("LLAMABUNDLE_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT,
                                    "a number of seconds greater than 0 (e.g. 10)"),
            cuda_redist_url=env.get("LLAMABUNDLE_CUDA_REDIST_URL", DEFAULT_CUDA_REDIST_URL).rstrip("/"),
            cuda_installer=Path(installer) if installer else None,
            cuda_installer_sha256=env.get("LLAMABUNDLE_CUDA_INSTALLER_SHA256") or None,
            build_timeout=seconds("LLAMABUNDLE_BUILD_TIMEOUT", DEFAULT_BUILD_TIMEOUT,
                                  "a number of seconds greater than 0 (e.g. 21600)"),
            cache_max=cache_max(env.get("LLAMABUNDLE_CACHE_MAX")),
            compiler_cache=compiler_cache(env.get("LLAMABUNDLE_COMPILER_CACHE")),
        )
