"""A/B arm: a 2-rank all_reduce up to 4 MiB goes through the outboxes (reads above)."""
try:
    from mpccs import direct_ops as _d
except ImportError:
    _d = None
if _d is not None:
    _d.DIRECT_CMA_FROM_BYTES = 4 << 20
