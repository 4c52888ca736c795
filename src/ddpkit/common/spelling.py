"""Environment variables that look like a misspelling of one torch, NCCL, CUDA, OpenMP or a
launcher reads (CUDA_VISIBLE_DIVICE): nothing reads them, so what the user meant has no
effect. Used by `ddpkit doctor` and by `ddpkit run` before it starts anything. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

# Variables that torch, NCCL, CUDA, the launchers and OpenMP read: a near-miss is a typo.
KNOWN_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_ORDER",
    "CUDA_HOME",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_DEBUG_FILE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_BUFFSIZE",
    "NCCL_NTHREADS",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_CROSS_NIC",
    "NCCL_TIMEOUT",
    "NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_LAUNCH_MODE",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_LOGS",
    "TORCH_HOME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "PYTORCH_CUDA_ALLOC_CONF",
)


def edit_distance(a: str, b: str, limit: int | None = None) -> int:
    """Levenshtein distance; with `limit`, limit + 1 for anything further, computed only on
    the band of cells within `limit` of the diagonal (every `ddpkit run` checks the whole
    environment against KNOWN_NAMES: the full table took ~0.3 s of its start)."""
    if limit is None:
        limit = max(len(a), len(b))
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    far = limit + 1
    previous = [j if j <= limit else far for j in range(len(b) + 1)]
    for i, ca in enumerate(a, 1):
        current = [i if i <= limit else far] + [far] * len(b)
        for j in range(max(1, i - limit), min(len(b), i + limit) + 1):
            current[j] = min(
                previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != b[j - 1]), far
            )
        if min(current) > limit:
            return far
        previous = current
    return previous[-1]


def _near(name: str, known: str) -> bool:
    """One letter off a name of up to 15 letters, two up to 23, three beyond."""
    limit = max(1, len(known) // 8)
    return edit_distance(name, known, limit) <= limit


def misspellings(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name set, name meant) for each variable one or two letters off a known name."""
    found = []
    for name in environ:
        if name in KNOWN_NAMES or len(name) < 5:
            continue
        close = [k for k in KNOWN_NAMES if _near(name, k)]
        if close:
            found.append((name, close[0]))
    return found
