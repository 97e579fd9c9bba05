"""The CUDA backend: ggml-cuda built by nvcc for the recipe's GPU architectures. Its rooms: `archs` (the
arch list and its split into SASS and PTX), `fatbin` (what an ELF or PE file really carries), `report`
(which GPUs run a bundle, natively or by JIT) and `toolkit/` (a portable CUDA toolkit: redist archives,
the Windows installer, PyPI wheels, or the system's)."""

from __future__ import annotations

import difflib
import fnmatch
import shutil
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import data, untrusted
from ...errors import ToolchainError, UsageError, VerifyError
from ...platforms.base import Extra
from ...reasons import Reason, Verdict
from ..base import IndexFacts, Launcher, NoExtras, Prepared
from . import companions
from .archs import check_archs, split_archs

if TYPE_CHECKING:
    from ...bundle.manifest import Manifest
    from ...log import Log
    from ...platforms.base import Platform
    from ...recipe import HostFacts, Recipe
    from ...settings import Settings
    from ..probing import Sight
    from . import section as cuda_section

REPRODUCIBLE_NVCC = ("-objtemp", "-Xcudafe=--orig_src_path_name=/llama.cpp")
DRIVER_LIBS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64")


class Cuda(NoExtras):
    name = "cuda"
    loader_name = "CUDA"
    gpu = True
    cmake_switch: str | None = "GGML_CUDA"
    languages: tuple[str, ...] = ("CUDA",)
    manifest_key: str | None = "cuda"
    driver_name = "NVIDIA driver"
    device_hint = "an NVIDIA GPU and driver"
    reasons: tuple[Reason, ...] = (Reason.OK, Reason.GPU_MISSING, Reason.DRIVER_TOO_OLD, Reason.BUNDLE_INVALID,
                                   Reason.CUDA_UNAVAILABLE, Reason.CUDA_STARTUP_FAILED, Reason.CUDA_LIBRARY_MISSING,
                                   Reason.CUDA_DRIVER_LIBRARY_MISSING, Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT,
                                   Reason.CUDA_ARCH_UNSUPPORTED, Reason.CUDA_PTX_TOO_NEW)
    works: Reason | None = Reason.OK
    device_fact = "cuda_device"
    hide_env: str | None = "CUDA_VISIBLE_DEVICES"

    def check_recipe(self, recipe: Recipe) -> None:
        """The toolkit is one this llamabundle knows, the components are in its manifest, the archs in what it
        supports (CUDA 13 dropped everything below sm_75)."""
        c = recipe.cuda
        assert c is not None
        toolkits = data.cuda_toolkits()
        if c.toolkit not in toolkits:
            raise recipe.error("cuda.toolkit", f"CUDA toolkit {c.toolkit} is not known to this llamabundle",
                               fix="use one of: " + ", ".join(toolkits))
        if not c.components:
            raise recipe.error("cuda.components", "the component list is empty")
        manifest = data.cuda_manifest(c.toolkit)
        for i, comp in enumerate(c.components):
            if comp not in manifest:
                hint = difflib.get_close_matches(comp, list(manifest), n=1)
                raise recipe.error(f"cuda.components[{i}]", f"'{comp}' is not a component of CUDA {c.toolkit}",
                                   fix=f"did you mean '{hint[0]}'?" if hint else "see NVIDIA's redistrib manifest")
        if len(set(c.components)) != len(c.components):
            raise recipe.error("cuda.components", "a component is listed twice")
        if len({n.lower() for n in c.libraries}) != len(c.libraries):
            raise recipe.error("cuda.libraries", "a library is listed twice")
        check_archs(c.archs, toolkits[c.toolkit]["archs"], toolkit=c.toolkit,
                    fail=lambda i, msg, fix: recipe.error(f"cuda.archs[{i}]" if c.archs else "cuda.archs", msg, fix))

    def key_inputs(self, recipe: Recipe, host: HostFacts) -> dict[str, Any]:
        """Toolkit, components, archs and driver floor (`"cuda": null` without CUDA); the libraries and the
        latent companions only when set, so that the keys of recipes without them stay as they were."""
        if recipe.cuda is None:
            return {"cuda": None}
        c = recipe.cuda
        cuda: dict[str, Any] = {"toolkit": c.toolkit, "components": sorted(c.components), "archs": sorted(c.archs),
                                "driver_floor": recipe.driver_floor}
        if c.libraries:
            cuda["libraries"] = sorted(c.libraries)
        if c.latent_companions != "ship":
            cuda["latent_companions"] = c.latent_companions
        return {"cuda": cuda}

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        return ("ggml-cuda",)

    def prepare(self, recipe: Recipe, host: HostFacts, *, settings: Settings, log: Log, env: Mapping[str, str],
                source: str | None) -> Prepared | None:
        """The pinned toolkit (found, or installed without admin rights), its nvcc and host compiler checked."""
        from .toolkit.resolve import check_toolkit, resolve_toolkit

        assert recipe.cuda is not None
        with log.step(f"CUDA toolkit {recipe.cuda.toolkit}"):
            toolkit = resolve_toolkit(recipe, settings=settings, log=log, env=env, source=source)
            checked = check_toolkit(toolkit, recipe, env=env)
            log.info(f"    nvcc {checked['nvcc']} at {toolkit.nvcc}; host compiler {checked['host']}")
            from . import determinism  # building only: reading a bundle does not load it (nor ctypes)

            refused = determinism.randomisation_refused() if recipe.platform.startswith("linux") else None
            if refused:
                log.warn(f"this machine keeps address randomisation on for nvcc ({refused}): the CUDA bundle "
                         "may differ from another build of the same inputs")
        return Prepared(root=toolkit.root, lib_dirs=tuple(toolkit.lib_dirs),
                        toolchain={"nvcc": checked["nvcc"]})

    def given_toolkit(self, recipe: Recipe, *, build_dir: Path, toolkit_root: Path | None) -> Prepared | None:
        """The toolkit the build compiled with: CMake's record of nvcc is the recipe's toolkit's nvcc, and
        --toolkit-root is that toolkit (by its version.json, where it has one)."""
        import re

        from .toolkit.layout import Toolkit

        assert recipe.cuda is not None
        if toolkit_root is None:
            raise UsageError("--toolkit-root is needed for a CUDA bundle",
                             why="the CUDA runtime libraries the bundle carries come from the toolkit the build used",
                             fix="pass the CUDA toolkit's root directory (the one with bin/ and lib/)")
        nvcc = None
        for f in sorted(build_dir.glob("CMakeFiles/*/CMakeCUDACompiler.cmake")):
            m = re.search(r'set\(CMAKE_CUDA_COMPILER_VERSION "([^"]*)"\)', f.read_text(encoding="utf-8", errors="replace"))
            nvcc = m.group(1) if m else nvcc
        want = str(data.cuda_manifest(recipe.cuda.toolkit)["cuda_nvcc"]["version"])
        if nvcc is None:
            raise UsageError(f"{build_dir} did not compile CUDA", why="CMake recorded no CUDA compiler there",
                             fix="configure the build with -DGGML_CUDA=ON, or bundle it with a recipe without cuda")
        if nvcc != want:
            raise ToolchainError(f"{build_dir} was compiled by nvcc {nvcc}, the recipe pins CUDA "
                                 f"{recipe.cuda.toolkit} (nvcc {want})", fix="bundle it with a recipe of that toolkit")
        version_file = toolkit_root / "version.json"
        if version_file.is_file():
            try:
                found = untrusted.read(version_file)["cuda"]["version"]
            except (OSError, ValueError, KeyError, TypeError):
                found = None
            if found is not None and str(found).split(".")[:2] != recipe.cuda.toolkit.split(".")[:2]:
                raise UsageError(f"--toolkit-root {toolkit_root} is CUDA {found}, the recipe pins {recipe.cuda.toolkit}",
                                 why=f"its {version_file.name} says so", fix="pass the toolkit the build used")
        tk = Toolkit(root=toolkit_root, version=recipe.cuda.toolkit, source="given", platform=recipe.platform)
        dirs = tuple(d for d in tk.lib_dirs if d.is_dir())
        if not dirs:
            raise UsageError(f"--toolkit-root {toolkit_root} has none of {', '.join(str(d) for d in tk.lib_dirs)}",
                             fix="pass the CUDA toolkit's root directory (the one with bin/ and lib/)")
        return Prepared(root=toolkit_root, lib_dirs=dirs, toolchain={"nvcc": nvcc})

    def show_line(self, recipe: Recipe, host: HostFacts) -> str | None:
        c = recipe.cuda
        assert c is not None
        return f"{c.toolkit} ({c.source}); archs {' '.join(c.archs)}; driver >= {recipe.driver_floor}"

    def cmake_definitions(self, recipe: Recipe, host: HostFacts, *, platform: Platform,
                          toolkit_root: Path | None) -> dict[str, str]:
        assert recipe.cuda is not None
        defs = {"CMAKE_CUDA_ARCHITECTURES": ";".join(recipe.cuda.archs)}
        if data.cuda_toolkits()[recipe.cuda.toolkit].get("compression") and \
                "GGML_CUDA_COMPRESSION_MODE" not in recipe.cmake_options:
            defs["GGML_CUDA_COMPRESSION_MODE"] = "size"  # nvcc --compress-mode (12.8+): a 6x smaller ggml-cuda
        if toolkit_root is not None:
            defs["CUDAToolkit_ROOT"] = str(toolkit_root)
            defs["CMAKE_CUDA_COMPILER"] = str(toolkit_root / "bin" / platform.program_file("nvcc"))
        return defs

    def prefix_map_flags(self, defs: Mapping[str, str], maps: Sequence[str]) -> dict[str, str]:
        """nvcc passes the maps to its host compiler, and two things of its own stop depending on where and
        when it runs: `-objtemp` writes its intermediate files beside the object, named after it (by default
        they are /tmp/tmpxft_<pid>_…, a name the host compiler records in every object); cudafe++ names the
        anonymous namespaces of CCCL's headers after a CRC of the source file's full path, which
        `--orig_src_path_name` fixes (the names stay per file through the file's base name, and without
        -rdc each file is its own device module). gcc, when it preprocesses for nvcc, would resolve the links
        of the fixed-length paths in the toolkit's headers (-fcanonical-system-headers is its default) and
        hand cicc the real toolkit path, whose length changed the PTX. Not enough on its own: see `launcher`."""
        gcc = ("-Xcompiler=-fno-canonical-system-headers",) if defs.get("CMAKE_C_COMPILER") == "gcc" else ()
        cuda = " ".join([*(f"-Xcompiler={m}" for m in maps), *REPRODUCIBLE_NVCC, *gcc])
        return {"CMAKE_CUDA_FLAGS": f"{defs.get('CMAKE_CUDA_FLAGS', '')} {cuda}".strip()}

    def launcher(self, recipe: Recipe, *, platform: Platform, source_dir: Path, build_dir: Path) -> Launcher | None:
        """On Linux, nvcc runs through determinism's launcher (a per-file -frandom-seed, no address
        randomisation, srand pinned), since two builds of the same inputs otherwise differ in some
        fattn-tile objects' PTX (measured on the H200 and with nvcc 13.0.88 here). MSVC builds have no such
        launcher and are not claimed reproducible."""
        if platform.system != "linux" or recipe.toolchain.compiler == "msvc":
            return None
        from ...compilers import EXECUTABLES
        from . import determinism

        return determinism.launcher(c_compiler=EXECUTABLES[recipe.toolchain.compiler][0], source_dir=source_dir,
                                    build_dir=build_dir)

    def runtime_extras(self, recipe: Recipe, bundled: Mapping[str, Path], lib_dirs: Sequence[Path], *,
                       platform: Platform) -> list[Extra]:
        """The libraries the bundled CUDA libraries load by name at run time (companions: cuBLASLt's NVRTC,
        NVRTC's builtins; latent ones unless the recipe omits them), and the toolkit libraries the recipe
        names in cuda.libraries. Each must be in the toolkit: else the fix names the component to add."""
        assert recipe.cuda is not None
        wide = platform.system == "windows"
        out: list[Extra] = []
        loaded = companions.named_by(dict(bundled), latent=recipe.cuda.latent_companions == "ship")
        for named in companions.missing_in(list(bundled), loaded, case_insensitive=wide):
            found = companions.find(named.name, lib_dirs, case_insensitive=wide)
            if found is None:
                omit = " or set cuda.latent_companions: omit" if named.rule.kind == "latent" else ""
                raise ToolchainError(f"{named.name} ({named.why}) is not in the toolkit",
                                     why=f"looked in {', '.join(map(str, lib_dirs)) or 'no toolkit directory'}; "
                                         f"evidence: {named.rule.evidence}",
                                     fix=f"add {named.rule.component} to cuda.components{omit}")
            out.append(Extra(path=found, why=named.why))
        for name in recipe.cuda.libraries:
            found = companions.find(name, lib_dirs, case_insensitive=wide)
            if found is None:
                raise ToolchainError(f"{name} (cuda.libraries) is not in the toolkit",
                                     why=f"looked in {', '.join(map(str, lib_dirs)) or 'no toolkit directory'}",
                                     fix="add the component that provides it to cuda.components, or correct the name")
            out.append(Extra(path=found, why="asked for by the recipe (cuda.libraries)"))
        return out

    def licenses(self, bundled: Mapping[str, Path], prepared: Prepared | None, stage: Path) -> dict[str, tuple[str, str]]:
        """The licence text of every CUDA component whose libraries the bundle redistributes: name -> (origin, why)."""
        if prepared is None:
            return {}
        root = prepared.root
        table = data.cuda_runtime()["components"]
        comps = sorted({c for name in bundled for pattern, c in table.items()
                        if fnmatch.fnmatchcase(name.lower(), pattern.lower())})
        covers: dict[str, list[str]] = {}  # licence file in the bundle -> the components whose terms it holds
        origin: dict[str, str] = {}
        for comp in comps:
            for cand in (root / f"LICENSE.{comp}", root / "EULA.txt", root / "DOCS" / "EULA.txt", root / "LICENSE"):
                if cand.is_file():
                    name = f"LICENSE-CUDA-{comp}.txt" if cand.name.startswith("LICENSE.") else "LICENSE-CUDA.txt"
                    shutil.copyfile(cand, stage / name)
                    origin[name] = "toolkit"
                    break
            else:  # a system toolkit without its license files (some container images strip them)
                notice = resources.files(data.__name__).joinpath("CUDA-EULA-NOTICE.txt").read_text(encoding="utf-8")
                name = "LICENSE-CUDA.txt"
                (stage / name).write_text(notice, encoding="utf-8")
                origin[name] = "llamabundle"
            covers.setdefault(name, []).append(comp)
        return {name: (origin[name], f"licence of the CUDA libraries it redistributes ({', '.join(cs)})"
                       + ("; the toolkit carried no licence file" if origin[name] == "llamabundle" else ""))
                for name, cs in covers.items()}

    def manifest_section(self, recipe: Recipe, host: HostFacts, stage: Path, *, platform: Platform,
                         prepared: Prepared | None) -> dict[str, Any] | None:
        """Toolkit, nvcc, the SASS and PTX ggml-cuda really carries, the driver floor, the compression mode."""
        from .fatbin import binary_archs

        assert recipe.cuda is not None
        found = binary_archs(stage / platform.library_file("ggml-cuda"))
        return {"toolkit": recipe.cuda.toolkit, "nvcc": prepared.toolchain.get("nvcc") if prepared else None,
                "archs": found.to_json(), "driver_floor": recipe.driver_floor,
                "compression_mode": recipe.cmake_options.get("GGML_CUDA_COMPRESSION_MODE", "size")}

    def read_section(self, manifest: Manifest) -> cuda_section.CudaInfo | None:
        from . import section as cuda_section

        return cuda_section.read(manifest)

    def section_schema(self) -> dict[str, Any] | None:
        from . import section as cuda_section

        return cuda_section.schema()

    def index_facts(self, manifest: Manifest) -> IndexFacts | None:
        """The toolkit, the SASS and PTX, and the driver floor (the index's CUDA and driver columns)."""
        from . import section as cuda_section

        info = cuda_section.read(manifest)
        if info is None:
            return None
        return IndexFacts(toolkit=info.toolkit, sass=info.sass, ptx=info.ptx, driver_floor=info.driver_floor)

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        """The SASS and PTX in ggml-cuda equal what the recipe asked for and what bundle.json records."""
        from . import section as cuda_section
        from .fatbin import binary_archs

        info = cuda_section.read(manifest)
        if info is None:
            return {}
        lib = platform.library_file("ggml-cuda")
        if not (root / lib).is_file():
            raise VerifyError(f"bundle.json declares CUDA but the bundle has no {lib}")
        found = binary_archs(root / lib).to_json()
        cuda_inputs = manifest.inputs.get("cuda")
        asked = cuda_inputs.get("archs", ()) if isinstance(cuda_inputs, Mapping) else ()
        wanted = split_archs([str(a) for a in asked])
        recorded = info.archs_json()
        if found != wanted:
            raise VerifyError(f"{lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                              why=f"the recipe asks for SASS {wanted['sass']} and PTX {wanted['ptx']}",
                              fix="rebuild the bundle; check CMAKE_CUDA_ARCHITECTURES reached nvcc")
        if recorded != found:
            said = f"SASS {recorded['sass']} and PTX {recorded['ptx']}"
            raise VerifyError(f"bundle.json records {said}, {lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                              fix="rebuild the bundle")
        out = {"archs": f"passed (SASS {' '.join(found['sass']) or '-'}; PTX {' '.join(found['ptx']) or '-'})"}
        return out | self.check_companions(root, manifest, platform=platform)

    def check_companions(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        """Every library a bundled CUDA library loads at run time is in the bundle (latent ones unless the
        recipe omitted them)."""
        present = [f.path for f in manifest.files]
        cuda_inputs = manifest.inputs.get("cuda")
        omit = isinstance(cuda_inputs, Mapping) and cuda_inputs.get("latent_companions") == "omit"
        wide = platform.system == "windows"
        fold = str.lower if wide else str
        asked = cuda_inputs.get("libraries", ()) if isinstance(cuda_inputs, Mapping) else ()
        have = {fold(p) for p in present}
        absent = [str(n) for n in asked if fold(str(n)) not in have]
        if absent:
            raise VerifyError(f"{absent[0]} is not in the bundle", why=f"the recipe asks for {', '.join(absent)} "
                              "(cuda.libraries)", fix="rebuild the bundle")
        named = companions.named_by({p: root / p for p in present}, latent=not omit)
        missing = companions.missing_in(present, named, case_insensitive=wide)
        if missing:
            lines = "; ".join(f"{n.name} ({n.why})" for n in missing)
            raise VerifyError(f"{missing[0].name} is not in the bundle", why=f"missing: {lines}",
                              fix="rebuild the bundle (collect ships every run-time companion)")
        if not named:
            return {}
        return {"companions": "passed (" + "; ".join(f"{n.by} -> {n.name}" for n in named) + ")"}

    def device_present(self) -> bool:
        """The NVIDIA kernel driver's device node, or its user-space library in a usual place."""
        if Path("/dev/nvidiactl").exists():
            return True
        return any(Path(d, "libcuda.so.1").exists() for d in DRIVER_LIBS)

    def verdict(self, sight: Sight) -> Verdict:
        """The GPU, the driver floor, the backend and its device, a kernel that runs there (diagnosis.py)."""
        from . import diagnosis

        return diagnosis.verdict(sight, loader_name=self.loader_name)

    def unserved(self, manifest: Manifest, devices: Sequence[str], compute_caps: Mapping[str, str]) -> str | None:
        """ggml-cuda lists a GPU that no kernel of the bundle runs on (on the H200 a bundle of sm_80 SASS listed
        `CUDA0: NVIDIA H200`, then aborted at its first kernel): each listed CUDA device's compute capability,
        as ggml-cuda reported it, against the SASS and PTX bundle.json records. None when one is served, or
        when the capabilities or the archs are not known."""
        from . import section as cuda_section
        from .report import Status, serving

        cuda = cuda_section.read(manifest)
        listed = [d.split(":", 1)[0] for d in devices if d.startswith(self.loader_name)]
        caps = {d: compute_caps[d] for d in listed if d in compute_caps}
        if cuda is None or not (cuda.sass or cuda.ptx) or not listed or len(caps) < len(listed):
            return None
        if any(serving(_cc(cc), sass=cuda.sass, ptx=cuda.ptx)[0] is not Status.UNSUPPORTED for cc in caps.values()):
            return None
        shown = ", ".join(f"{d} (compute capability {cc})" for d, cc in caps.items())
        return (f"{shown} is listed, but no kernel of the bundle runs on it (SASS: {', '.join(cuda.sass) or 'none'}; "
                f"PTX: {', '.join(cuda.ptx) or 'none'}): the bundle is for other GPUs")


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


CUDA = Cuda()
