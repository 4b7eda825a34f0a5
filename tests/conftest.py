"""The tests target the CPU (several of them as several virtual CPU devices)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
