"""The backup and restore procedure of docs/operations.md ("HA etcd"), on a real 3-member cluster.

`etcdctl snapshot save` from a live cluster; later writes; the cluster lost; `etcdutl snapshot
restore` of that snapshot into each member's new data directory with the documented flags
(--bump-revision, --mark-compacted); the members started again on the same addresses. The store
then holds what the snapshot held, new writes get revisions above every one a client saw before,
and a watch that ran through it all is not left waiting for revisions the restored cluster had
already passed: it is told its revision was compacted, lists again, and follows new writes.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store, with_retries
from libs.state.watch import PrefixWatch, Resync, WatchEvent
from tools.etcd.server import EtcdCluster, etcd_ctl_tools

# Far above any revision a running deployment reaches between two backups (docs/operations.md).
BUMP_REVISION = 1_000_000_000


def run(*argv: str | Path) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{argv[0]} failed: {proc.stderr or proc.stdout}"
    return proc.stdout


async def test_snapshot_restore_keeps_the_snapshot_and_watches_relist(etcd_bin: Path, tmp_path: Path) -> None:
    etcdctl, etcdutl = etcd_ctl_tools()
    cluster = EtcdCluster.create(tmp_path / "etcd", 3, binary=etcd_bin)
    cluster.start()
    try:
        config = EtcdConfig(endpoint=cluster.endpoints, prefix="/b/", timeout_s=5.0)
        async with Store(config) as store:
            for i in range(10):
                await store.put(f"/b/k/{i}", pb.Claim(uid=f"saved-{i}"))
            seen: list[WatchEvent[pb.Claim] | Resync[pb.Claim]] = []
            relisted, new_seen = asyncio.Event(), asyncio.Event()

            async def follow() -> None:
                async for event in PrefixWatch(store, "/b/k/", pb.Claim):
                    seen.append(event)
                    if isinstance(event, Resync) and len([e for e in seen if isinstance(e, Resync)]) > 1:
                        relisted.set()
                    if isinstance(event, WatchEvent) and event.key == "/b/k/new":
                        new_seen.set()

            watching = asyncio.create_task(follow())
            try:
                snapshot = tmp_path / "snapshot.db"
                # From one member (etcdctl refuses several): any member's snapshot is the cluster's.
                run(etcdctl, f"--endpoints={cluster.members[1].endpoint}", "snapshot", "save", snapshot)
                for i in range(10, 15):  # after the backup: lost by the restore
                    await store.put(f"/b/k/{i}", pb.Claim(uid=f"lost-{i}"))
                before = await store.revision()
                await asyncio.sleep(0.5)
                assert max(e.revision for e in seen) == before  # the watch is at the newest revision

                # The cluster is lost; each member is restored from the snapshot as documented.
                initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster.members)
                for member in cluster.members:
                    member.kill()
                for member in cluster.members:
                    restored = member.data_dir.with_name(member.data_dir.name + "-restored")
                    run(
                        etcdutl, "snapshot", "restore", snapshot,
                        f"--name={member.name}", f"--data-dir={restored}",
                        f"--initial-cluster={initial}", "--initial-cluster-token=restored",
                        f"--initial-advertise-peer-urls={member.peer_url}",
                        f"--bump-revision={BUMP_REVISION}", "--mark-compacted",
                    )  # fmt: skip
                    member.data_dir = restored
                cluster.start()

                async with asyncio.timeout(60):
                    await relisted.wait()
                items, _ = await with_retries(lambda: store.list("/b/k/", pb.Claim), "list")
                assert sorted(v.value.uid for v in items) == sorted(f"saved-{i}" for i in range(10))
                revision = await with_retries(
                    lambda: store.put("/b/k/new", pb.Claim(uid="new")), "put after restore"
                )
                assert revision > max(before, BUMP_REVISION)  # never below what a client saw
                async with asyncio.timeout(10):
                    await new_seen.wait()
                last_resync = [e for e in seen if isinstance(e, Resync)][-1]
                assert sorted(v.value.uid for v in last_resync.items) == sorted(
                    f"saved-{i}" for i in range(10)
                )
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
    finally:
        cluster.destroy()
