"""Test setup: 8 emulated CPU devices, configured before any backend use; property tests
derandomized so that a CI run is reproducible (set HYPOTHESIS_PROFILE=explore locally to
search with fresh random examples)."""

import os

import jax
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)

# The plan cache is off in tests (every test searches, and nothing is written into the
# user's home); the cache's own tests point AUTOPAR_CACHE_DIR at a temporary folder.
os.environ["AUTOPAR_CACHE_DIR"] = ""

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
