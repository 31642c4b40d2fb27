"""The `resource.nvidia.com/computeDomain=<CD uid>` label on the Nodes of a domain's members.

Level-triggered, like the rest of the adapter: for one domain uid the wanted
set of labelled nodes is computed from the controller's view of the store
(`desired_nodes`), compared with what Kubernetes carries (`plan_labels`), and
only the difference is patched. Both halves of the decision are pure.

What Kubernetes carries is kept in `NodeLabelCache`: one list of the labelled
Nodes when leadership starts (and again after each periodic resync), then
updated by our own patches. It is only a hint for what to patch: every patch
reads the Node first and is conditional on its resourceVersion, so a stale
hint costs one read, never a wrong label:

- labelling never replaces a label that names another domain the node is
  still a member of (`may_take`);
- unlabelling removes the label only while it still names this uid.

A member without a Node object (a simulated node, or a Node deleted since)
answers 404: nothing to label. It is remembered as absent until the next
resync, so it costs no call per reconcile and no retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial
from typing import Literal

import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from services.controller.kube.computedomain import LABEL_KEY
from services.controller.observed import MemberRecord

log = structlog.get_logger(__name__)

_CALL_TIMEOUT_S = 30.0
# Nodes patched at once for one domain (a 256-node domain forms in a few reconciles).
_CONCURRENCY = 8

# ---- the pure core ---------------------------------------------------------------------------


def desired_nodes(domain_exists: bool, members: Mapping[str, MemberRecord]) -> frozenset[str]:
    """The nodes that should carry this domain's label: all its members, lost ones included.

    A LOST member keeps its node binding until it is released (its prepared claims are gone):
    the node cannot join another domain meanwhile and its pods may still run (an agent that
    crashed is not a node that died). The label follows the binding, so an agent restart does
    not make the label flap; it goes when the controller releases the member.
    Members of a domain whose record is absent (a join that raced the teardown) are orphans
    about to be released: not labelled.
    """
    return frozenset(members) if domain_exists else frozenset()


@dataclass(frozen=True, slots=True)
class LabelPlan:
    label: tuple[str, ...] = ()  # nodes to label with the uid
    unlabel: tuple[str, ...] = ()  # nodes whose label names the uid and that should lose it

    def __bool__(self) -> bool:
        return bool(self.label or self.unlabel)


def plan_labels(
    uid: str, desired: AbstractSet[str], current: Mapping[str, str], absent: AbstractSet[str] = frozenset()
) -> LabelPlan:
    """What to patch so that exactly `desired` carries `uid`.

    `current`: node -> the uid its label names, for (at least) the desired nodes and the nodes
    labelled with `uid`; a node missing from it carries no label. `absent`: nodes known not to
    exist in Kubernetes (not labelled, nothing to unlabel).
    """
    label = tuple(sorted(n for n in desired if current.get(n) != uid and n not in absent))
    unlabel = tuple(
        sorted(n for n, v in current.items() if v == uid and n not in desired and n not in absent)
    )
    return LabelPlan(label, unlabel)


def may_take(label_now: str | None, uid: str, member_of: AbstractSet[str]) -> bool:
    """Whether a node whose label names `label_now` may be labelled with `uid`.

    `member_of`: the existing domains the node is a member of (store view). A label naming
    another domain is replaced only when the node is no longer that domain's member (left over
    from a domain it left, or that is gone); never while that domain still holds the node.
    """
    return not label_now or label_now == uid or label_now not in member_of


# ---- what Kubernetes carries -----------------------------------------------------------------


class NodeLabelCache:
    """node -> uid its label names, as last listed or patched by us; plus nodes found absent."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}
        self.by_uid: dict[str, set[str]] = {}
        self.absent: set[str] = set()
        self.loaded = False

    def replace(self, labels: Mapping[str, str]) -> None:
        self.labels = {}
        self.by_uid = {}
        self.absent = set()
        for node, uid in labels.items():
            self.record(node, uid)
        self.loaded = True

    def record(self, node: str, uid: str | None) -> None:
        """`node` now carries `uid` (None: no label)."""
        old = self.labels.pop(node, None)
        if old is not None:
            nodes = self.by_uid.get(old)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self.by_uid[old]
        if uid:
            self.labels[node] = uid
            self.by_uid.setdefault(uid, set()).add(node)

    def mark_absent(self, node: str) -> None:
        self.record(node, None)
        self.absent.add(node)

    def current_for(self, uid: str, nodes: Iterable[str]) -> dict[str, str]:
        """The labels of `nodes` and of every node labelled with `uid` (the input of plan_labels)."""
        out = {n: self.labels[n] for n in nodes if n in self.labels}
        for n in self.by_uid.get(uid, ()):
            out[n] = uid
        return out


# ---- the API calls -----------------------------------------------------------------------------

Result = Literal["labelled", "unlabelled", "unchanged", "absent", "held"]


@dataclass(frozen=True, slots=True)
class Outcome:
    result: Result
    # The uid the node's label names afterwards ("" for none), when the node exists.
    label: str = ""


def _label_of(node: object) -> str:
    labels = getattr(getattr(node, "metadata", None), "labels", None) or {}
    return str(labels.get(LABEL_KEY, ""))


async def list_domain_labels(api: ApiClient) -> dict[str, str]:
    """node -> uid, for every Node that carries the label (any value)."""
    nodes = await CoreV1Api(api).list_node(label_selector=LABEL_KEY, _request_timeout=_CALL_TIMEOUT_S)
    return {n.metadata.name: _label_of(n) for n in nodes.items}


async def list_nodes_labelled(api: ApiClient, uid: str) -> list[str]:
    nodes = await CoreV1Api(api).list_node(
        label_selector=f"{LABEL_KEY}={uid}", _request_timeout=_CALL_TIMEOUT_S
    )
    return sorted(n.metadata.name for n in nodes.items)


async def label_node(api: ApiClient, node: str, uid: str, member_of: AbstractSet[str]) -> Outcome:
    def decide(now: str) -> Outcome | None:
        if now == uid:
            return Outcome("unchanged", uid)
        return None if may_take(now, uid, member_of) else Outcome("held", now)

    return await _patch_label(api, node, decide, uid, Outcome("labelled", uid))


async def unlabel_node(api: ApiClient, node: str, uid: str) -> Outcome:
    return await _patch_label(
        api, node, lambda now: None if now == uid else Outcome("unchanged", now), None, Outcome("unlabelled")
    )


async def _patch_label(
    api: ApiClient,
    node: str,
    decide: Callable[[str], Outcome | None],
    value: str | None,
    done: Outcome,
) -> Outcome:
    """Read the Node; unless `decide` (given its current label) answers first, set the label to
    `value` (None removes it) on that resourceVersion, so a concurrent change makes it fail."""
    core = CoreV1Api(api)
    try:
        current = await core.read_node(node, _request_timeout=_CALL_TIMEOUT_S)
        answer = decide(_label_of(current))
        if answer is not None:
            return answer
        await core.patch_node(
            node,
            {
                "metadata": {
                    "labels": {LABEL_KEY: value},
                    "resourceVersion": current.metadata.resource_version,
                }
            },
            _request_timeout=_CALL_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status == 404:
            return Outcome("absent")
        raise
    return done


# ---- one domain at a time ------------------------------------------------------------------------

Call = Callable[[], Awaitable[Outcome]]


class NodeLabeler:
    """Applies `plan_labels` for one domain uid at a time, keeping `cache` in step."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.cache = NodeLabelCache()
        self._loading = asyncio.Lock()

    def invalidate(self) -> None:
        """List the labelled Nodes again before the next sync (and retry the absent ones)."""
        self.cache.loaded = False

    async def ensure_loaded(self) -> None:
        async with self._loading:
            if not self.cache.loaded:
                self.cache.replace(await list_domain_labels(self.api))

    async def sync(
        self,
        uid: str,
        desired: frozenset[str],
        member_of: Callable[[str], AbstractSet[str]],
        cd: str = "",
        namespace: str = "",
    ) -> LabelPlan:
        """Patch the difference between `desired` and the labels; raise the first failure."""
        await self.ensure_loaded()
        plan = plan_labels(uid, desired, self.cache.current_for(uid, desired), self.cache.absent)
        if plan:
            calls: list[tuple[str, Call]] = [
                (n, partial(label_node, self.api, n, uid, member_of(n))) for n in plan.label
            ]
            calls += [(n, partial(unlabel_node, self.api, n, uid)) for n in plan.unlabel]
            await self._run(uid, calls, cd, namespace)
        return plan

    async def remove_all(self, uid: str, cd: str = "", namespace: str = "") -> int:
        """Remove `uid`'s label from every Node that carries it (listed now, not from the cache)."""
        nodes = set(await list_nodes_labelled(self.api, uid)) | self.cache.by_uid.get(uid, set())
        calls: list[tuple[str, Call]] = [(n, partial(unlabel_node, self.api, n, uid)) for n in sorted(nodes)]
        await self._run(uid, calls, cd, namespace)
        return len(nodes)

    async def _run(self, uid: str, calls: list[tuple[str, Call]], cd: str, namespace: str) -> None:
        limit = asyncio.Semaphore(_CONCURRENCY)

        async def one(call: Call) -> Outcome:
            async with limit:
                return await call()

        results = await asyncio.gather(*(one(c) for _, c in calls), return_exceptions=True)
        failures: list[BaseException] = []
        for (node, _), outcome in zip(calls, results, strict=True):
            ctx = {"cd_uid": uid, "cd": cd, "namespace": namespace, "node": node}
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                failures.append(outcome)
                log.warning("node label patch failed", **ctx, error=str(outcome) or type(outcome).__name__)
            elif outcome.result == "absent":
                self.cache.mark_absent(node)
                log.debug("no such node in kubernetes; nothing to label", **ctx)
            else:
                self.cache.record(node, outcome.label or None)
                if outcome.result == "labelled":
                    log.info("node labelled", **ctx)
                elif outcome.result == "unlabelled":
                    log.info("node label removed", **ctx)
                elif outcome.result == "held":
                    log.info(
                        "node label names another domain the node is in; left alone",
                        **ctx,
                        other=outcome.label,
                    )
        if failures:
            raise failures[0]
