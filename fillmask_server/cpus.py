"""The CPUs this process may use: its CPU affinity, within the CPU quota of its cgroup and of every cgroup
above it (a container's or a Kubernetes pod's CPU limit), which neither the CPU count nor the affinity shows;
and (``memory_left``) the memory it may still take, within the same cgroups' memory limits.

No torch and no threads: the settings' checks (``config``) and the start-up calibration both ask it, so a
``--torch-threads`` warning and the calibration's candidate counts agree on the same number.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

CGROUP_ROOT = "/sys/fs/cgroup"  # cgroup v2's mount (a container's own cgroup, as it sees it)
CGROUP_V2_CPU_MAX = f"{CGROUP_ROOT}/cpu.max"
CGROUP_V1_CPU_DIRS = (f"{CGROUP_ROOT}/cpu", f"{CGROUP_ROOT}/cpu,cpuacct")
CGROUP_V1_MEMORY_DIR = f"{CGROUP_ROOT}/memory"
PROC_MEMINFO = "/proc/meminfo"
PROC_SELF_CGROUP = "/proc/self/cgroup"  # this process's cgroup in each hierarchy


def usable_cpus(read: Callable[[str], str | None] | None = None) -> int:
    """The CPUs this process may use: those it may run on, and no more than its cgroup's CPU quota
    (a container's CPU limit, rounded up), which the CPU count does not show: a container limited to
    2 CPUs on a 64-core node that ran 64 threads would be throttled most of each period."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cpu_quota(read or _read_text)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cpu_quota(read: Callable[[str], str | None]) -> float | None:
    """The tightest cgroup CPU quota on this process, in CPUs, or None when there is none or none can be read;
    ``read(path)`` gives a file's text or None.

    A quota binds every process below the cgroup that has it, so each level is read, from the process's own
    cgroup (``/proc/self/cgroup``) up to the mount's root: a Kubernetes pod's limit or a systemd slice's
    quota sits on a cgroup above the container's, and a host that mounts every cgroup shows the process's
    own one deep below the root. A container that sees only its own cgroup has it at the mount's root, which
    the walk always reads. cgroup v2's ``cpu.max`` where the unified hierarchy has one at any level, else
    v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` under the ``cpu`` controller's mount."""
    paths = _cgroup_paths(read(PROC_SELF_CGROUP))
    quotas: list[float] = []
    found_v2 = False
    for directory in _levels(CGROUP_ROOT, paths.get("")):
        text = read(f"{directory}/cpu.max")
        if text is None:
            continue
        found_v2 = True
        fields = text.split()
        if len(fields) == 2 and fields[0] != "max" and (ratio := _ratio(fields[0], fields[1])) is not None:
            quotas.append(ratio)
    if not found_v2:
        for mount in CGROUP_V1_CPU_DIRS:
            for directory in _levels(mount, paths.get("cpu")):
                quota, period = read(f"{directory}/cpu.cfs_quota_us"), read(f"{directory}/cpu.cfs_period_us")
                if quota is not None and period is not None and (ratio := _ratio(quota, period)) is not None:
                    quotas.append(ratio)
    return min(quotas) if quotas else None


def memory_left(read: Callable[[str], str | None] | None = None) -> int | None:
    """Bytes of memory this process may still take, or None when none of it can be read: the kernel's
    ``MemAvailable``, and at each cgroup level from the process's own up to the mount's root (as
    ``cpu_quota`` walks them) its limit less its usage (v2's ``memory.max`` and ``memory.current``; where
    no level has them, v1's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` under the ``memory``
    controller's mount): the least of them."""
    read = read or _read_text
    found: list[int] = []
    for line in (read(PROC_MEMINFO) or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            found.append(int(fields[1]) * 1024)
    paths = _cgroup_paths(read(PROC_SELF_CGROUP))
    levels = [(f"{d}/memory.max", f"{d}/memory.current") for d in _levels(CGROUP_ROOT, paths.get(""))]
    v1 = [(f"{d}/memory.limit_in_bytes", f"{d}/memory.usage_in_bytes")
          for d in _levels(CGROUP_V1_MEMORY_DIR, paths.get("memory"))]
    limits = [(read(limit), read(usage)) for limit, usage in levels]
    if not any(limit is not None for limit, _ in limits):
        limits = [(read(limit), read(usage)) for limit, usage in v1]
    for limit, usage in limits:
        if limit is not None and usage is not None and limit.isdigit() and usage.isdigit():
            found.append(int(limit) - int(usage))  # (v1's "no limit" is a huge number: never the least)
    return max(0, min(found)) if found else None


def _cgroup_paths(text: str | None) -> dict[str, str]:
    """``/proc/self/cgroup``'s paths: the unified (v2) hierarchy's under "", the v1 hierarchies that hold
    the ``cpu`` and the ``memory`` controllers under "cpu" and "memory"."""
    paths: dict[str, str] = {}
    for line in (text or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        if fields[1] == "":
            paths[""] = fields[2]
            continue
        for controller in ("cpu", "memory"):
            if controller in fields[1].split(","):
                paths[controller] = fields[2]
    return paths


def _levels(mount: str, path: str | None) -> list[str]:
    """The directories of the cgroup ``path`` under ``mount`` and of each cgroup above it, the mount last."""
    parts = [part for part in (path or "").split("/") if part and part != "."]
    if ".." in parts:  # a cgroup outside this process's cgroup namespace: only the mount's root is its own
        return [mount]
    return [mount + "".join(f"/{part}" for part in parts[:depth]) for depth in range(len(parts), -1, -1)]


def _ratio(quota: str, period: str) -> float | None:
    try:
        value, per = int(quota), int(period)
    except ValueError:
        return None
    return value / per if value > 0 and per > 0 else None  # -1: no quota (v1)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:  # cgroup names may be any bytes
            return file.read().strip()
    except OSError:
        return None
