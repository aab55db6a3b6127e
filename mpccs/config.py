"""Runtime options: one object, documented defaults, ``MPCCS_*`` environment
overrides, ``mpccs.init(**kwargs)`` overrides on top. Unknown keys are refused
(as mpi4py's ``rc`` does), so a typo never silently falls back to a default.

The full reference with every key is docs/configuration.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping, Optional, Union

from .errors import ConfigError

PLANE_NAMES = ("up", "out")

# Transport names UCX accepts in UCX_TLS (aliases included). Checked so that a
# typo fails at init with the list, not deep inside UCX with "no such device".
KNOWN_TLS = (
    "all", "sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem", "self",
    "tcp", "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x",
    "ud_verbs", "ud_mlx5", "dc", "dc_x", "dc_mlx5", "cuda", "cuda_copy", "cuda_ipc",
    "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "rocm_gdr", "ze_copy", "ze_ipc",
)

DEFAULT_UP_TLS_CPU = "posix,cma,sysv,self"
DEFAULT_OUT_TLS = "tcp"

PathPolicy = Union[str, float]


def parse_tls(value: str, plane: str) -> str:
    """Validate a comma-separated UCX transport list; '^' negation is allowed."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"plane {plane!r}: empty transport list")
    for name in names:
        bare = name.lstrip("^")
        base = bare.split(":")[0]
        if base not in KNOWN_TLS:
            raise ConfigError(
                f"plane {plane!r}: unknown UCX transport {name!r}; valid names: {', '.join(KNOWN_TLS)}"
            )
    return ",".join(names)


def parse_planes(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise ConfigError("MPCCS_PLANES is empty; valid planes: up, out")
    for name in names:
        if name not in PLANE_NAMES:
            raise ConfigError(f"unknown plane {name!r}; valid planes: {', '.join(PLANE_NAMES)}")
    return names


def parse_policy(value: PathPolicy) -> PathPolicy:
    """'up', 'out', 'adaptive', or a float fraction of bytes on 'up' in [0, 1]."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        frac = float(value)
    elif isinstance(value, str) and value in ("up", "out", "adaptive"):
        return value
    else:
        try:
            frac = float(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"unknown path policy {value!r}; valid: 'up', 'out', 'adaptive' or a fraction in [0, 1]"
            ) from None
    if not 0.0 <= frac <= 1.0:
        raise ConfigError(f"path policy fraction {frac} is outside [0, 1]")
    return frac


def parse_size(value: Union[str, int]) -> int:
    """'1M', '256K', '4096' -> bytes (binary units)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    try:
        return int(float(digits) * mult)
    except ValueError:
        raise ConfigError(f"cannot read size {value!r} (examples: 4096, 256K, 1M)") from None


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
               "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}
MIN_OUT_CAP_RATE_BPS = 1e6  # below this one 1 MiB chunk waits over a second for its tokens


def parse_rate(value: Union[str, float, int]) -> float:
    """'250mbit', '1gbit' (bits/s, tc's spelling), '30MB' (bytes/s), or a number of bytes/s."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower().rstrip("/s")  # '30MB/s' reads too
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            digits, mult = text[: -len(unit)], _RATE_UNITS[unit]
            break
    else:
        digits, mult = text, 1.0
    try:
        return float(digits) * mult
    except ValueError:
        raise ConfigError(f"cannot read rate {value!r} (examples: 250mbit, 1gbit, 30MB, 31250000)") from None


def parse_plane_rates(value) -> tuple[tuple[str, float], ...]:
    """'up=5GB,out=700MB' (rates as parse_rate reads them), or a {plane: rate}
    mapping: what the planes carry, as (plane, bytes/s) pairs in plane order."""
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = []
        for token in (t.strip() for t in str(value).split(",") if t.strip()):
            name, sep, rate = token.partition("=")
            if not sep:
                raise ConfigError(f"plane rate {token!r} needs plane=rate (e.g. up=5GB,out=700MB)")
            items.append((name.strip(), rate))
    if not items:
        raise ConfigError("no plane rate given (e.g. up=5GB,out=700MB)")
    rates = {}
    for name, rate in items:
        if name not in PLANE_NAMES:
            raise ConfigError(f"unknown plane {name!r} in plane rates; valid planes: {', '.join(PLANE_NAMES)}")
        if name in rates:
            raise ConfigError(f"plane {name!r} is given two rates")
        rates[name] = parse_rate(rate)
        if rates[name] <= 0:
            raise ConfigError(f"plane {name!r}: rate {rate!r} is not positive")
    return tuple((name, rates[name]) for name in PLANE_NAMES if name in rates)


def parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "y", "yes", "true", "on"):
        return True
    if text in ("0", "n", "no", "false", "off"):
        return False
    raise ConfigError(f"cannot read boolean {value!r} (use 0 or 1)")


# Where reductions of device (cupy) arrays are computed (mpccs.staging):
# 'always' on the device, 'never' on the pinned host mirrors, 'auto' where an
# H200 host measured the device to pay (bench/results/gpu_reduce_h200):
# reduce_scatter and reduce from 16 MiB (1.2-1.9x); all_reduce stays on the
# mirrors (the host ring overlaps its two halves; the device path, two
# collectives back to back, was 0.8x).
DEVICE_REDUCE_MODES = ("auto", "always", "never")


def parse_device_reduce(value) -> str:
    return _parse_auto_mode(value, DEVICE_REDUCE_MODES)


def _parse_auto_mode(value, modes: tuple) -> str:
    """One of ``modes`` ('auto', 'always', 'never'), with 1 / true for 'always' and 0 / false for 'never'."""
    text = str(value).strip().lower()
    text = {"1": "always", "0": "never", "true": "always", "false": "never"}.get(text, text)
    if text not in modes:
        raise ConfigError(f"cannot read {value!r}; use one of {', '.join(modes)}")
    return text


# Whether a 2-rank in-place all_reduce flushes the cache lines its second read
# lands in (control/landing.py): 'auto' decides from the landings' times.
LANDING_FLUSH_MODES = ("auto", "never", "always")


def parse_landing_flush(value) -> str:
    return _parse_auto_mode(value, LANDING_FLUSH_MODES)


# Whether the planes read device (cupy) memory themselves (GPU-direct): the up
# plane adds UCX's cuda_ipc and cuda_copy transports, the out plane cuda_copy
# (UCX stages device chunks through host fragments for tcp), and device arrays
# travel without mirrors (mpccs.staging). 'auto': on when cupy sees a GPU.
GPU_DIRECT_MODES = ("auto", "on", "off")
GPU_DIRECT_UP_TLS = ("cuda_copy", "cuda_ipc")
GPU_DIRECT_OUT_TLS = ("cuda_copy",)


def parse_gpu_direct(value) -> str:
    text = str(value).strip().lower()
    text = {"1": "on", "0": "off", "true": "on", "false": "off", "yes": "on", "no": "off"}.get(text, text)
    if text not in GPU_DIRECT_MODES:
        raise ConfigError(f"cannot read {value!r}; use one of {', '.join(GPU_DIRECT_MODES)}")
    return text


def with_device_tls(tls: str, extra: tuple) -> str:
    """``tls`` plus the device transports it does not name already (a '^' list
    excludes what it names, so it keeps them, as does 'all')."""
    names = {t.split(":")[0] for t in tls.split(",")}
    if tls.startswith("^") or "all" in names:
        return tls
    return ",".join([tls] + [t for t in extra if t not in names])


@dataclass(frozen=True)
class Options:
    planes: tuple[str, ...] = PLANE_NAMES
    up_tls: Optional[str] = None  # None: the host transports (device arrays are staged through pinned host mirrors)
    up_devices: Optional[str] = None
    out_tls: str = DEFAULT_OUT_TLS
    out_devices: Optional[str] = None  # None: 'lo' when every rank is on one host, else all
    domain: Optional[str] = None  # None: the host name
    path_policy: PathPolicy = "adaptive"
    multipath: bool = True
    chunk_bytes: Optional[int] = None  # None: the tuner picks per call
    timeout_s: float = 60.0  # no-progress timeout, not wall time
    rendezvous_timeout_s: float = 60.0
    tune: Optional[str] = None
    trace: Optional[str] = None
    out_cap_share: float = 1.0
    out_cap_rate_Bps: Optional[float] = None  # QoS: borrowed scale-out bytes/s, paced (None: no cap)
    plane_rates: Optional[tuple] = None  # ((plane, bytes/s), ...): the planes' rates as known; None: the priors
    measure_plan_rates: bool = True  # without plane_rates: the ranks measure and agree on them (control/plan_rates.py)
    fingerprint: bool = True
    failover: bool = True  # retry a collective on the plane left when one fails
    two_step: bool = True  # 2-rank all_reduce on 'up' alone: two messages each way, not the DAG (two_step.py)
    shm: bool = True  # ranks on one host: small calls and 2-rank blocks through shared-memory segments (shm.py, shm_group.py)
    cma: bool = True  # with the segments: 2-rank collectives read the peer's blocks across processes (cma_steps.py)
    landing_flush: str = "auto"  # flush an in-place 2-rank all_reduce's landing lines first (LANDING_FLUSH_MODES)
    device_reduce: str = "auto"  # where reductions of device arrays are computed (DEVICE_REDUCE_MODES)
    gpu_direct: str = "auto"  # planes that read device memory (GPU_DIRECT_MODES)
    plane_timeout_s: float = 1.0  # heartbeat silence that marks a plane down
    reprobe_s: float = 5.0  # how long a failed plane rests before a rejoin probe


# option name -> (environment variable, parser)
_ENV = {
    "planes": ("MPCCS_PLANES", parse_planes),
    "up_tls": ("MPCCS_UP_TLS", lambda v: parse_tls(v, "up")),
    "up_devices": ("MPCCS_UP_DEVICES", str),
    "out_tls": ("MPCCS_OUT_TLS", lambda v: parse_tls(v, "out")),
    "out_devices": ("MPCCS_OUT_DEVICES", str),
    "domain": ("MPCCS_DOMAIN", str),
    "path_policy": ("MPCCS_PATH", parse_policy),
    "multipath": ("MPCCS_MULTIPATH", parse_bool),
    "chunk_bytes": ("MPCCS_CHUNK", parse_size),
    "timeout_s": ("MPCCS_TIMEOUT", float),
    "rendezvous_timeout_s": ("MPCCS_RENDEZVOUS_TIMEOUT", float),
    "tune": ("MPCCS_TUNE", str),
    "trace": ("MPCCS_TRACE", str),
    "out_cap_share": ("MPCCS_OUT_CAP", float),
    "out_cap_rate_Bps": ("MPCCS_OUT_CAP_RATE", parse_rate),
    "plane_rates": ("MPCCS_PLANE_RATES", parse_plane_rates),
    "measure_plan_rates": ("MPCCS_MEASURE_PLAN_RATES", parse_bool),
    "fingerprint": ("MPCCS_FINGERPRINT", parse_bool),
    "failover": ("MPCCS_FAILOVER", parse_bool),
    "two_step": ("MPCCS_TWO_STEP", parse_bool),
    "shm": ("MPCCS_SHM", parse_bool),
    "cma": ("MPCCS_CMA", parse_bool),
    "landing_flush": ("MPCCS_LANDING_FLUSH", parse_landing_flush),
    "device_reduce": ("MPCCS_DEVICE_REDUCE", lambda v: parse_device_reduce(v)),
    "gpu_direct": ("MPCCS_GPU_DIRECT", lambda v: parse_gpu_direct(v)),
    "plane_timeout_s": ("MPCCS_PLANE_TIMEOUT", float),
    "reprobe_s": ("MPCCS_REPROBE", float),
}


def _parse_override(name: str, value):
    """Keyword overrides go through the same parsers as the environment."""
    _, parse = _ENV[name]
    if name == "planes" and isinstance(value, (list, tuple)):
        return parse_planes(",".join(value))
    if isinstance(value, str) or name in ("path_policy", "plane_rates"):
        return parse(value)
    return value


def load_options(environ=None, **overrides) -> Options:
    """Defaults, then MPCCS_* variables, then keyword overrides (validated)."""
    environ = os.environ if environ is None else environ
    valid = {f.name for f in fields(Options)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid: {', '.join(sorted(valid))}")
    values = {}
    for name, (var, parse) in _ENV.items():
        if var in environ and environ[var] != "":
            try:
                values[name] = parse(environ[var])
            except ConfigError as exc:
                raise ConfigError(f"{var}: {exc}") from None
            except ValueError:
                raise ConfigError(f"{var}={environ[var]!r} is not a valid value") from None
    for name, value in overrides.items():
        if value is not None:
            values[name] = _parse_override(name, value)
    opts = replace(Options(), **values)
    if not opts.multipath:
        # MPCCS_MULTIPATH=0 is exactly the single-plane library.
        opts = replace(opts, path_policy="up")
    if opts.chunk_bytes is not None and opts.chunk_bytes < 4096:
        raise ConfigError(f"chunk_bytes={opts.chunk_bytes} is below the 4096-byte minimum")
    if not 0.0 <= opts.out_cap_share <= 1.0:
        raise ConfigError(f"out_cap_share={opts.out_cap_share} is outside [0, 1]")
    if opts.out_cap_rate_Bps is not None and opts.out_cap_rate_Bps < MIN_OUT_CAP_RATE_BPS:
        raise ConfigError(f"out_cap_rate_Bps={opts.out_cap_rate_Bps:g} is below {MIN_OUT_CAP_RATE_BPS:g} B/s "
                          "(8 Mbit/s): pacing would hold chunks for seconds")
    for name in ("timeout_s", "plane_timeout_s", "reprobe_s"):
        if getattr(opts, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    return opts
