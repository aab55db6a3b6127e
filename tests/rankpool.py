"""A pool of live ranks for multi-process tests.

Starting UCX and rendezvous costs about a second per rank, so a test module
keeps one pool alive and runs many cases on it: ``pool.run(fn, *args)``
calls ``fn(comm, *args)`` on every rank (``fn`` must be a module-level
function, sent by reference) and returns the per-rank results. A rank's
exception comes back to the parent as ``RankFailure`` with its traceback. A
case that does not finish within its timeout kills the pool (it cannot be
trusted afterwards) and fails the test; it never hangs the suite.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import traceback
from typing import Optional

from mpccs.launch import free_port


class RankFailure(AssertionError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def init_communicator(init_kwargs: dict):
    """The default per-rank set-up: a world communicator (what cases receive)."""
    import mpccs

    return mpccs.init(**init_kwargs)


def _worker(rank: int, env: dict, conn, setup, setup_arg) -> None:
    os.environ.update(env)
    try:
        comm = setup(setup_arg)
    except BaseException:  # noqa: BLE001 - report anything to the parent
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(comm, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        comm.close()
    except Exception:
        pass
    conn.send(("closed", None))


class RankPool:
    def __init__(self, size: int, env: Optional[dict] = None, init_kwargs: Optional[dict] = None,
                 start_timeout: float = 60.0, setup=init_communicator):
        """``setup(init_kwargs)`` runs once in each rank (a module-level function); its
        result is what every case receives as first argument, and is closed at the end."""
        self.size = size
        ctx = mp.get_context("spawn")
        port, token = free_port(), secrets.token_hex(8)
        self._conns, self._procs = [], []
        for rank in range(size):
            rank_env = {
                "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MPCCS_JOB_TOKEN": token,
                "MPCCS_TIMEOUT": "30",
            }
            rank_env.update(env or {})
            if callable(rank_env.get("MPCCS_DOMAIN")):
                rank_env["MPCCS_DOMAIN"] = rank_env["MPCCS_DOMAIN"](rank)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, rank_env, child, setup, init_kwargs or {}), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(start_timeout, "start-up")

    def _collect(self, timeout: float, what: str) -> list:
        results, failures = [None] * self.size, {}
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self.kill()
                raise TimeoutError(f"rank {rank} did not finish {what} within {timeout:g} s (pool killed)")
            status, value = conn.recv()
            if status == "err":
                failures[rank] = value
            results[rank] = value
        if failures:
            raise RankFailure(failures)
        return results

    def run(self, fn, *args, timeout: float = 60.0, **kwargs) -> list:
        """fn(comm, *args, **kwargs) on every rank; per-rank results in rank order."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", "case"))

    def run_each(self, per_rank_args: list, fn, timeout: float = 60.0) -> list:
        """Like run, with a different argument tuple for each rank."""
        for conn, args in zip(self._conns, per_rank_args):
            conn.send((fn, tuple(args), {}))
        return self._collect(timeout, getattr(fn, "__name__", "case"))

    def close(self, timeout: float = 20.0) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
