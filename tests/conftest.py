import os
import sys

# Multi-rank tests import case functions from this folder in child processes.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))

try:
    from hypothesis import settings

    settings.register_profile("mpccs", derandomize=True, max_examples=25, deadline=None)
    settings.load_profile("mpccs")
except ImportError:  # hypothesis is in the test extra
    pass
