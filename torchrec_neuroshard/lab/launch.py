"""Process groups: the backend and device chosen by hardware, and a spawn helper.

Every code path that measures runs unchanged on CPU (gloo) and CUDA (NCCL): the backend
and the device come from ``torch.cuda.is_available()`` and the local rank, nothing else.

On a CPU host ranks start from a fork server that imported torch, FBGEMM and TorchRec
once: a fresh interpreter spends about 7 s of CPU importing them (2-core host), which
every rank of every ``spawn`` paid before. Where CUDA is present ranks are spawned fresh
as before (a process forked after the driver started may not use it).
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def default_device(local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when a GPU is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the group torchrun describes in the environment: (rank, world size, device)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = default_device(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            default_backend(device),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return rank, world_size, device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PRELOADED = ("torch", "fbgemm_gpu", "torchrec", "torchrec.distributed")
"""Modules the fork server imports once; every rank forks from it with them loaded."""


def rank_context() -> Any:
    """The multiprocessing context ranks start in: on a CPU host a fork server with
    ``PRELOADED`` imported where the platform has one, else ``spawn``."""
    if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _in_environment(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()  # a fork server's environment is the one it started with
    os.environ.update(environ)
    return target(*args)


def start_process(ctx: Any, target: Callable[..., Any], *args: Any, daemon: bool = False) -> Any:
    """Start ``target(*args)`` in a process of ``ctx`` (``rank_context()``) that sees the
    caller's environment as it is now, working directory and ``sys.path`` too; returns it."""
    proc = ctx.Process(target=_in_environment, args=(dict(os.environ), target, *args), daemon=daemon)
    proc.start()
    return proc


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        init_from_env()
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then re-raised there
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one group.

    ``fn`` must be importable (module level). Each rank sees the caller's environment,
    working directory and ``sys.path``. Returns each rank's return value by rank; a
    failure on any rank raises ``RuntimeError`` with that rank's traceback.
    """
    ctx = rank_context()
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [start_process(ctx, _worker, r, world_size, port, fn, args, results) for r in range(world_size)]
    outs: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, ok, out = results.get()
        if ok:
            outs[rank] = out
        else:
            errors.append(f"rank {rank}: {out}")
            break
    if errors:
        for p in procs:
            p.terminate()
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [outs[r] for r in range(world_size)]
