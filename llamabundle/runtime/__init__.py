"""The consumer side (DESIGN §1, §5, §8): install a bundle on demand (install.py), probe which backend will
run and why (probe.py; the reason codes are the ground's reasons.py), doctor, live telemetry, and the VRAM
offload planner (offload.py with the GGUF reader, the llama-server flags and the bundle's dry run)."""
