"""The inotify budget that bounds how many real kubelets one machine runs.

The kernel lets each user hold `fs.inotify.max_user_instances` inotify instances (128 by default),
counted over all of that user's processes. A kubelet on crisim holds INSTANCES_PER_KUBELET of them
and a loopback control plane INSTANCES_PER_CONTROL_PLANE; everything else the user runs (other
clusters, editors, other engineers' tests as the same user) draws on the same budget. This module
reads the limit and what is in use, so that an environment can refuse to start more kubelets than
fit, naming the budget, instead of failing later with kubelet's "inotify_init: too many open
files". Nothing here changes the limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAX_USER_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
# Measured with tools/sim/kubelet/node.py's configuration (count of anon_inode:inotify fds per
# process): kubelet 4 (cAdvisor's cgroup watcher, the plugin watcher, the FlexVolume prober, one
# without a watch; the serving-certificate watch is switched off), crisim 0.
INSTANCES_PER_KUBELET = 4
# kube-apiserver 6, kube-controller-manager 6, kube-scheduler 1 (tools/controlplane).
INSTANCES_PER_CONTROL_PLANE = 13
# Left free for whatever else the user starts meanwhile (two kubelets' worth).
HEADROOM = 8


class InotifyBudgetExceeded(RuntimeError):
    """More kubelets were asked for than the user's inotify instances allow; the message says how many fit."""


@dataclass(frozen=True)
class InotifyBudget:
    limit: int  # fs.inotify.max_user_instances
    in_use: int  # held by this user's processes now

    @property
    def free(self) -> int:
        return max(0, self.limit - self.in_use)

    def kubelets_that_fit(self, control_planes: int = 0, headroom: int = HEADROOM) -> int:
        """How many more kubelets fit after `control_planes` more control planes and `headroom`."""
        spare = self.free - control_planes * INSTANCES_PER_CONTROL_PLANE - headroom
        return max(0, spare // INSTANCES_PER_KUBELET)

    def require(self, kubelets: int, control_planes: int = 0, headroom: int = HEADROOM) -> None:
        """Raise InotifyBudgetExceeded unless `kubelets` (and `control_planes`) fit with `headroom`."""
        fit = self.kubelets_that_fit(control_planes, headroom)
        if kubelets > fit:
            planes = (
                f" and {control_planes} control plane(s) ({INSTANCES_PER_CONTROL_PLANE} each)"
                if control_planes
                else ""
            )
            raise InotifyBudgetExceeded(
                f"{kubelets} real kubelets do not fit this machine's inotify budget: "
                f"fs.inotify.max_user_instances is {self.limit}, this user's processes hold "
                f"{self.in_use}, each kubelet takes {INSTANCES_PER_KUBELET}{planes}, and {headroom} "
                f"stay free for other programs; at most {fit} kubelets fit now. Ask for fewer nodes "
                f"or stop other clusters (this tool does not raise the kernel limit)"
            )


def instances_in_use(uid: int | None = None) -> int:
    """The inotify instances held by the processes of `uid` (default: ours), from /proc/*/fd."""
    uid = os.getuid() if uid is None else uid
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            for fd in (proc / "fd").iterdir():
                try:
                    if os.readlink(fd) == "anon_inode:inotify":
                        count += 1
                except OSError:
                    continue  # closed meanwhile
        except OSError:
            continue  # the process ended meanwhile
    return count


def current_budget() -> InotifyBudget:
    return InotifyBudget(limit=int(MAX_USER_INSTANCES.read_text()), in_use=instances_in_use())
