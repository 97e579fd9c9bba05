"""The CUDA backend: ggml-cuda built by nvcc for the recipe's GPU architectures. Its rooms: `archs` (the
arch list and its split into SASS and PTX), `fatbin` (what an ELF or PE file really carries), `report`
(which GPUs run a bundle, natively or by JIT) and `toolkit/` (a portable CUDA toolkit: redist archives,
the Windows installer, PyPI wheels, or the system's)."""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import data
from ...errors import VerifyError
from ..base import NoExtras, Prepared
from .archs import split_archs
from .fatbin import binary_archs

if TYPE_CHECKING:
    from ...bundle.manifest import Manifest
    from ...log import Log
    from ...platforms.base import Platform
    from ...recipe import Recipe
    from ...settings import Settings

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

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        return ("ggml-cuda",)

    def prepare(self, recipe: Recipe, *, settings: Settings, log: Log, env: Mapping[str, str],
                source: str | None) -> Prepared | None:
        """The pinned toolkit (found, or installed without admin rights), its nvcc and host compiler checked."""
        from .toolkit.resolve import check_toolkit, resolve_toolkit

        assert recipe.cuda is not None
        with log.step(f"CUDA toolkit {recipe.cuda.toolkit}"):
            toolkit = resolve_toolkit(recipe, settings=settings, log=log, env=env, source=source)
            checked = check_toolkit(toolkit, recipe, env=env)
            log.info(f"    nvcc {checked['nvcc']} at {toolkit.nvcc}; host compiler {checked['host']}")
        return Prepared(root=toolkit.root, lib_dirs=tuple(toolkit.lib_dirs),
                        toolchain={"nvcc": checked["nvcc"]})

    def cmake_definitions(self, recipe: Recipe, *, platform: Platform, toolkit_root: Path | None) -> dict[str, str]:
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
        """nvcc passes the maps to its host compiler."""
        cuda = " ".join(f"-Xcompiler={m}" for m in maps)
        return {"CMAKE_CUDA_FLAGS": f"{defs.get('CMAKE_CUDA_FLAGS', '')} {cuda}".strip()}

    def companions(self, bundled: Mapping[str, Path], lib_dirs: Sequence[Path]) -> list[Path]:
        """Libraries CUDA's own libraries load at run time (nvrtc's builtins), from data/cuda_runtime.json."""
        table = data.cuda_runtime()["companions"]
        found: list[Path] = []
        for name in bundled:
            for pattern, wanted in table.items():
                if fnmatch.fnmatchcase(name, pattern):
                    for w in wanted:
                        for d in lib_dirs:
                            hits = sorted(p for p in d.glob(w) if p.is_file())
                            if hits:
                                found.append(hits[-1])
                                break
        return found

    def licenses(self, bundled: Mapping[str, Path], prepared: Prepared | None, stage: Path) -> dict[str, str]:
        """The license text of every CUDA component whose libraries the bundle redistributes."""
        if prepared is None:
            return {}
        root = prepared.root
        table = data.cuda_runtime()["components"]
        comps = sorted({c for name in bundled for pattern, c in table.items() if fnmatch.fnmatchcase(name, pattern)})
        roles: dict[str, str] = {}
        for comp in comps:
            for cand in (root / f"LICENSE.{comp}", root / "EULA.txt", root / "DOCS" / "EULA.txt", root / "LICENSE"):
                if cand.is_file():
                    name = f"LICENSE-CUDA-{comp}.txt" if cand.name.startswith("LICENSE.") else "LICENSE-CUDA.txt"
                    shutil.copyfile(cand, stage / name)
                    roles[name] = "license"
                    break
            else:  # a system toolkit without its license files (some container images strip them)
                notice = resources.files(data.__name__).joinpath("CUDA-EULA-NOTICE.txt").read_text(encoding="utf-8")
                (stage / "LICENSE-CUDA.txt").write_text(notice, encoding="utf-8")
                roles["LICENSE-CUDA.txt"] = "license"
        return roles

    def manifest_section(self, recipe: Recipe, stage: Path, *, platform: Platform,
                         prepared: Prepared | None) -> dict[str, Any] | None:
        """Toolkit, nvcc, the SASS and PTX ggml-cuda really carries, the driver floor, the compression mode."""
        assert recipe.cuda is not None
        found = binary_archs(stage / platform.library_file("ggml-cuda"))
        return {"toolkit": recipe.cuda.toolkit, "nvcc": prepared.toolchain.get("nvcc") if prepared else None,
                "archs": found.to_json(), "driver_floor": recipe.driver_floor,
                "compression_mode": recipe.cmake_options.get("GGML_CUDA_COMPRESSION_MODE", "size")}

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        """The SASS and PTX in ggml-cuda equal what the recipe asked for and what bundle.json records."""
        if manifest.cuda is None:
            return {}
        lib = platform.library_file("ggml-cuda")
        if not (root / lib).is_file():
            raise VerifyError(f"bundle.json declares CUDA but the bundle has no {lib}")
        found = binary_archs(root / lib).to_json()
        cuda_inputs = manifest.inputs.get("cuda")
        asked = cuda_inputs.get("archs", ()) if isinstance(cuda_inputs, Mapping) else ()
        wanted = split_archs([str(a) for a in asked])
        recorded = manifest.cuda.archs_json()
        if found != wanted:
            raise VerifyError(f"{lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                              why=f"the recipe asks for SASS {wanted['sass']} and PTX {wanted['ptx']}",
                              fix="rebuild the bundle; check CMAKE_CUDA_ARCHITECTURES reached nvcc")
        if recorded != found:
            said = f"SASS {recorded['sass']} and PTX {recorded['ptx']}"
            raise VerifyError(f"bundle.json records {said}, {lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                              fix="rebuild the bundle")
        return {"archs": f"passed (SASS {' '.join(found['sass']) or '-'}; PTX {' '.join(found['ptx']) or '-'})"}

    def device_present(self) -> bool:
        """The NVIDIA kernel driver's device node, or its user-space library in a usual place."""
        if Path("/dev/nvidiactl").exists():
            return True
        return any(Path(d, "libcuda.so.1").exists() for d in DRIVER_LIBS)


CUDA = Cuda()
