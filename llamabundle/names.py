"""The names a recipe and a bundle share: the platforms and the backends (each one a module in platforms/ and
backends/; a test checks they agree), and the form of a CUDA architecture. Apart from the recipe model so that
reading a bundle (bundle.manifest, the backends' checks: a fetch, an install) does not load the recipe's."""

from __future__ import annotations

from typing import Literal

Platform = Literal["linux-x86_64", "linux-aarch64", "windows-x86_64"]
Backend = Literal["cpu", "cuda", "vulkan", "rpc"]
ARCH_PATTERN = r"^([0-9]{2,3})([af]?)(-(real|virtual))?$"  # NN[a|f][-real|-virtual] (ECMA syntax: no named groups)
