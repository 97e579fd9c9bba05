"""What every ggml backend answers: its CMake switch and definitions, its targets, the toolkit it needs
(prepared before the build), what it adds to runtime collection, its section of bundle.json, its verify
checks, and how the loader and `--list-devices` name it (what verify's gpu level and probe ask)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..reasons import Reason, Verdict

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..platforms.base import Extra, Platform
    from ..recipe import HostFacts, Recipe, ToolFound
    from ..settings import Settings
    from .probing import Sight


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a backend's toolkit step gave the build: the toolkit's root and library directories, and the
    versions bundle.json's `toolchain` records (e.g. {"nvcc": "13.0.88"})."""
    root: Path
    lib_dirs: tuple[Path, ...] = ()
    toolchain: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class IndexFacts:
    """What a store's index shows of a bundle for its backend: the toolkit it was built with, the GPU code it
    carries (SASS and PTX), and the driver it needs."""
    toolkit: str
    sass: tuple[str, ...] = ()
    ptx: tuple[str, ...] = ()
    driver_floor: str | None = None


@dataclass(frozen=True, kw_only=True)
class Launcher:
    """A compiler launcher a backend puts in front of its language's compiler (before ccache), with the files
    it needs in the build tree and the commands that make them, run before configuring."""
    language: str  # CMake language: CUDA
    argv: tuple[str, ...]
    files: tuple[tuple[str, str], ...] = ()  # (path, text)
    commands: tuple[tuple[str, ...], ...] = ()
    why: str = ""


RunEnv = Callable[[], AbstractContextManager[Mapping[str, str]]]  # for one run: the variables it needs, while it lasts


@dataclass(frozen=True)
class OpsDevices:
    """What a backend adds to the ops level: device name -> what each test-backend-ops run against it needs (the
    variables, and anything that must live as long as the run: RPC's server), or why it adds none here (`skipped`)."""

    devices: Mapping[str, RunEnv] = field(default_factory=dict)
    skipped: str | None = None
    serves: str | None = None  # the local device behind the devices added (RPC: what its server serves)


@runtime_checkable
class Backend(Protocol):
    """One ggml backend. Implementations are module-level singletons registered in `backends`."""

    name: str  # as recipes and bundle.json name it: cpu, cuda
    loader_name: str  # as ggml's loader and --list-devices name it: CPU, CUDA
    gpu: bool  # a GPU backend: verify's gpu level and probe look for its device
    cmake_switch: str | None  # GGML_CUDA: ON when a recipe has the backend, OFF otherwise (None: always built)
    languages: tuple[str, ...]  # CMake languages it compiles besides C and C++ (compiler launchers, prefix maps)
    manifest_key: str | None  # its section of bundle.json ("cuda"), or None
    driver_name: str  # what must be installed for its device to work ("NVIDIA driver")
    device_hint: str  # the machine a GPU check needs ("an NVIDIA GPU and driver")
    run_env: tuple[str, ...]  # variables of the caller's environment the bundle keeps when verify runs it (driver lookup)
    reasons: tuple[Reason, ...]  # the reason codes its probe verdict can give
    works: Reason | None  # the code of a verdict that it runs here (ok, vulkan_ok)
    device_fact: str  # the fact its verdict names the device by (cuda_device, device)
    hide_env: str | None  # the variable that, set and empty, hides its devices from llama-server

    def check_recipe(self, recipe: Recipe) -> None:
        """The recipe's rules this backend knows (a recipe that has it): raises recipe.error(…) at the line."""
        ...

    def host_tool(self, recipe: Recipe, *, env: Mapping[str, str] | None, building: bool = False) -> ToolFound | None:
        """The tool of this machine the key names for a recipe that has it (None: none). Where the recipe pins
        the tool, the key needs nothing of this machine: it is looked for only when `building` (the build runs it)."""
        ...

    def pin_warning(self, recipe: Recipe) -> str | None:
        """For `recipe lint`: the tool of a recipe that has this backend whose version the key takes from the
        machine computing it, as one sentence (None: none, or pinned)."""
        ...

    def key_inputs(self, recipe: Recipe, host: HostFacts) -> dict[str, Any]:
        """The entries it adds to the key inputs, whether or not the recipe has it (raises ToolchainError when
        the key needs a tool this machine lacks)."""
        ...

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        """The CMake targets of its backend modules (loaded at run time, not linked)."""
        ...

    def programs(self, recipe: Recipe) -> tuple[str, ...]:
        """The CMake targets of programs it adds to the bundle (RPC's ggml-rpc-server), beside the recipe's."""
        ...

    def prepare(self, recipe: Recipe, host: HostFacts, *, settings: Settings, log: Log, env: Mapping[str, str],
                source: str | None) -> Prepared | None:
        """Before the build: find or install the toolkit the backend needs and check it (None: it needs none)."""
        ...

    def given_toolkit(self, recipe: Recipe, *, build_dir: Path, toolkit_root: Path | None) -> Prepared | None:
        """For `bundle` (a build made elsewhere, in `build_dir`): the toolkit that build used (`toolkit_root`,
        from --toolkit-root), checked against the recipe and the build's CMake records; None: it needs none."""
        ...

    def show_line(self, recipe: Recipe, host: HostFacts) -> str | None:
        """What `show` prints about it for a recipe that has it (its toolkit, the tool found here), or None."""
        ...

    def cmake_definitions(self, recipe: Recipe, host: HostFacts, *, platform: Platform,
                          toolkit_root: Path | None) -> dict[str, str]:
        """Cache definitions for a recipe that has this backend."""
        ...

    def after_configure(self, recipe: Recipe, host: HostFacts, configure_log: str) -> None:
        """After CMake configured the tree (its output): check what it found agrees with the key; raises BuildError."""
        ...

    def prefix_map_flags(self, defs: Mapping[str, str], maps: Sequence[str]) -> dict[str, str]:
        """Flags of its languages that map the source and build paths (`maps`: -ffile-prefix-map=…)."""
        ...

    def launcher(self, recipe: Recipe, *, platform: Platform, source_dir: Path, build_dir: Path) -> Launcher | None:
        """A launcher for its compiler (None: none). A backend with one is compiled through source and build
        paths of one fixed length (build.py: its compiler's output follows their lengths)."""
        ...

    def project_include(self, recipe: Recipe) -> list[str]:
        """Lines for the CMake project include (CMAKE_PROJECT_INCLUDE) a recipe with this backend needs."""
        ...

    def runtime_extras(self, recipe: Recipe, bundled: Mapping[str, Path], lib_dirs: Sequence[Path], *,
                       platform: Platform) -> list[Extra]:
        """Libraries to bundle that no import entry names (loaded at run time by what is bundled, or asked
        for by the recipe), found in `lib_dirs`, each with why it is there."""
        ...

    def licenses(self, bundled: Mapping[str, Path], prepared: Prepared | None, stage: Path) -> dict[str, tuple[str, str]]:
        """Copy the licence texts of what it redistributes into `stage`: name -> (origin, why)."""
        ...

    def manifest_section(self, recipe: Recipe, host: HostFacts, stage: Path, *, platform: Platform,
                         prepared: Prepared | None) -> dict[str, Any] | None:
        """Its section of bundle.json, read from the staged files (None: it has none)."""
        ...

    def read_section(self, manifest: Manifest) -> object | None:
        """Its section of a bundle.json, typed (None: the bundle has none); a wrong field is a ManifestError."""
        ...

    def section_schema(self) -> dict[str, Any] | None:
        """The JSON schema of its section (None: it has none), in data/schemas/bundle.schema.json."""
        ...

    def index_facts(self, manifest: Manifest) -> IndexFacts | None:
        """Its cells of the store index's row (`llamabundle index`): None when it has nothing to show."""
        ...

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        """Its static checks of an unpacked bundle that has it: level name -> "passed (…)"; raises VerifyError."""
        ...

    def check_loaded(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                     env: Mapping[str, str]) -> dict[str, str]:
        """At the load level, after the platform's check passed: what it runs of the bundle itself (RPC: its server,
        and llama-server using it), `runner` how this machine runs the bundle's programs (None: it cannot), `env`
        the clean environment; level name -> "passed (…)" or "skipped: why"; raises VerifyError."""
        ...

    def after_ops_tool(self, tool: Path, *, build_dir: Path, platform: Platform, log: Log,
                       env: Mapping[str, str]) -> None:
        """After `build --ops-tool` wrote test-backend-ops to `tool` from the bundle's build tree: what the
        backend's part of the ops level needs beside it (RPC: its preload library)."""
        ...

    adds_ops_devices: bool

    def ops_devices(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                    env: Mapping[str, str], tool: Path, gpus: Sequence[str] = ()) -> OpsDevices:
        """At the ops level (where `adds_ops_devices`): the devices the backend adds to test-backend-ops' runs from
        `root` (RPC: the device of the bundle's own server, a fresh one for each run), given the GPU devices the
        ops level tests here (`gpus`)."""
        ...

    def device_present(self) -> bool:
        """A GPU backend: this machine has the device driver (so its backend should have loaded)."""
        ...

    def verdict(self, sight: Sight) -> Verdict:
        """A GPU backend: whether it runs the bundle here (`works`), else why not, with the facts behind it."""
        ...

    def unserved(self, manifest: Manifest, devices: Sequence[str], compute_caps: Mapping[str, str]) -> str | None:
        """A GPU backend whose devices are listed: why no kernel of the bundle runs on any of them (the bundle's
        code targets other GPUs), or None when one can or it cannot be told."""
        ...


class NoExtras:
    """The defaults of a backend that needs no toolkit, no extra runtime files and no checks of its own."""

    cmake_switch: str | None = None
    languages: tuple[str, ...] = ()
    manifest_key: str | None = None
    driver_name = "device driver"
    device_hint = "a device and its driver"
    run_env: tuple[str, ...] = ()
    reasons: tuple[Reason, ...] = ()
    works: Reason | None = None
    device_fact = "device"
    hide_env: str | None = None
    adds_ops_devices = False  # ops_devices may add devices to the ops level (RPC)

    def check_recipe(self, recipe: Recipe) -> None:
        return None

    def host_tool(self, recipe: Recipe, *, env: Mapping[str, str] | None, building: bool = False) -> ToolFound | None:
        return None

    def pin_warning(self, recipe: Recipe) -> str | None:
        return None

    def key_inputs(self, recipe: Recipe, host: HostFacts) -> dict[str, Any]:
        return {}

    def prepare(self, recipe: Recipe, host: HostFacts, *, settings: Settings, log: Log, env: Mapping[str, str],
                source: str | None) -> Prepared | None:
        return None

    def given_toolkit(self, recipe: Recipe, *, build_dir: Path, toolkit_root: Path | None) -> Prepared | None:
        return None

    def show_line(self, recipe: Recipe, host: HostFacts) -> str | None:
        return None

    def cmake_definitions(self, recipe: Recipe, host: HostFacts, *, platform: Platform,
                          toolkit_root: Path | None) -> dict[str, str]:
        return {}

    def prefix_map_flags(self, defs: Mapping[str, str], maps: Sequence[str]) -> dict[str, str]:
        return {}

    def after_configure(self, recipe: Recipe, host: HostFacts, configure_log: str) -> None:
        return None

    def launcher(self, recipe: Recipe, *, platform: Platform, source_dir: Path, build_dir: Path) -> Launcher | None:
        return None

    def project_include(self, recipe: Recipe) -> list[str]:
        return []

    def runtime_extras(self, recipe: Recipe, bundled: Mapping[str, Path], lib_dirs: Sequence[Path], *,
                       platform: Platform) -> list[Extra]:
        return []

    def licenses(self, bundled: Mapping[str, Path], prepared: Prepared | None, stage: Path) -> dict[str, tuple[str, str]]:
        return {}

    def manifest_section(self, recipe: Recipe, host: HostFacts, stage: Path, *, platform: Platform,
                         prepared: Prepared | None) -> dict[str, Any] | None:
        return None

    def read_section(self, manifest: Manifest) -> object | None:
        return None

    def section_schema(self) -> dict[str, Any] | None:
        return None

    def index_facts(self, manifest: Manifest) -> IndexFacts | None:
        return None

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        return {}

    def programs(self, recipe: Recipe) -> tuple[str, ...]:
        return ()

    def check_loaded(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                     env: Mapping[str, str]) -> dict[str, str]:
        return {}

    def after_ops_tool(self, tool: Path, *, build_dir: Path, platform: Platform, log: Log,
                       env: Mapping[str, str]) -> None:
        return None

    def ops_devices(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                    env: Mapping[str, str], tool: Path, gpus: Sequence[str] = ()) -> OpsDevices:
        return OpsDevices()

    def device_present(self) -> bool:
        return False

    def verdict(self, sight: Sight) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__} is not a GPU backend: probe asks it nothing")

    def unserved(self, manifest: Manifest, devices: Sequence[str], compute_caps: Mapping[str, str]) -> str | None:
        return None
