"""CUDA toolkit without admin rights: plan (pure) and install from NVIDIA's redist archives,
the Windows local installer, PyPI wheels, or an installed system toolkit (DESIGN §3)."""
