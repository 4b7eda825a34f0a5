"""The tests target the CPU (several of them as several virtual CPU devices), and share one
compilation cache, so that the many runs of the same tiny configurations compile once."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="egg-jax-test-cache-"))
