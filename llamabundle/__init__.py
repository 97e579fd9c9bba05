"""llamabundle: build, verify, cache and publish llama.cpp binary bundles."""

__version__ = "0.1.0"
