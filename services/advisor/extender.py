"""kube-scheduler extender endpoint (HTTP JSON): `filter` and `prioritize` verbs.

Wire format is k8s.io/kube-scheduler/extender/v1: the Go structs have no JSON
tags, so kube-scheduler sends and expects the Go field names:
  ExtenderArgs          {"Pod": <v1.Pod>, "Nodes": <v1.NodeList>|null, "NodeNames": [..]|null}
  ExtenderFilterResult  {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
  HostPriorityList      [{"Host": <node>, "Score": <0..10>}]
With nodeCacheCapable=true kube-scheduler sends NodeNames and reads NodeNames;
otherwise it sends whole Node objects in Nodes and reads Nodes. Go's decoder
matches keys case-insensitively, so we accept any case on input too.

A pod is ours when one of its spec.resourceClaims names a ResourceClaimTemplate
that belongs to a ComputeDomain; its nodes are narrowed to the domain's clique
(see domain_placement). Every other pod passes through untouched. A malformed
request is HTTP 400 with a JSON body {"Error": <message naming the field>}; a body over the size limit is
413, one not in whole within the read timeout 408, and JSON nested deeper than the
parser's MAX_JSON_DEPTH levels 400 naming that limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import simdjson
import structlog
from aiohttp import web

from libs.runtime.errors import PermanentError
from libs.runtime.text_limits import clip
from services.advisor.domain_placement import SIZE_ANNOTATION, DomainPlacer
from services.advisor.domain_sources import DomainSizeSource, TemplateDomainSource
from services.advisor.metrics import AdvisorMetrics

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
# simdjson's fixed nesting limit (its DEFAULT_MAX_DEPTH); deeper documents are refused by the parser.
MAX_JSON_DEPTH = 1024


class BadRequest(PermanentError, ValueError):
    """The request body does not have the shape kube-scheduler sends; the message names the field."""


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    pod: Mapping[str, Any]
    # The candidates' names, in the order kube-scheduler sent them.
    candidate_names: list[str]
    # When kube-scheduler sent whole Nodes (not nodeCacheCapable): the parsed request's
    # Nodes.items, still in simdjson's form, so that a kept Node goes back as the bytes it came as.
    node_items: Any = None

    @property
    def whole_nodes(self) -> bool:
        return self.node_items is not None

    def node_json(self, index: int) -> bytes:
        """The candidate at `index` as kube-scheduler sent it (minified JSON)."""
        return bytes(self.node_items[index].mini)


def _get(obj: Any, name: str) -> Any:
    """A field the way Go's encoding/json finds it: exact key first, then case-insensitive."""
    value = obj.get(name)
    if value is not None or name in obj:
        return value
    lowered = name.lower()
    for key in obj.keys():
        if isinstance(key, str) and key.lower() == lowered:
            return obj.get(key)
    return None


def parse_args(body: bytes) -> ExtenderArgs:
    """ExtenderArgs from a request body; BadRequest naming the field otherwise.

    simdjson, not a full parse: a 500-Node body (1.8 MB) is indexed in under a millisecond, and
    only the pod and the candidates' names become Python objects (orjson.loads built all of it:
    ~8 ms here). Each request has its own parser, so requests never share a document."""
    try:
        data = simdjson.Parser().parse(body)
    except ValueError as exc:
        raise BadRequest(f"request body is not JSON: {clip(str(exc))}") from None
    except RuntimeError as exc:  # simdjson's other refusals, DEPTH_ERROR among them
        if "DEPTH" in str(exc):
            raise BadRequest(
                f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels (the limit)"
            ) from None
        raise BadRequest(f"request body is not JSON: {clip(str(exc))}") from None
    if not isinstance(data, simdjson.Object):
        raise BadRequest(f"request body must be a JSON object (ExtenderArgs), got {_kind(data)}")
    raw_pod = _get(data, "Pod")
    if not isinstance(raw_pod, simdjson.Object):
        raise BadRequest("Pod: missing or not an object")
    pod = _checked_pod(raw_pod.as_dict())

    node_names = _get(data, "NodeNames")
    nodes_obj = _get(data, "Nodes")
    if node_names is not None:
        if not isinstance(node_names, simdjson.Array):
            raise BadRequest("NodeNames: not a list")
        names: list[str] = []
        for i, name in enumerate(node_names.as_list()):
            if not isinstance(name, str) or not name:
                raise BadRequest(f"NodeNames[{i}]: not a non-empty string")
            names.append(name)
        return ExtenderArgs(pod, names)
    if nodes_obj is None:
        raise BadRequest("NodeNames / Nodes: one of them must be given")
    if not isinstance(nodes_obj, simdjson.Object):
        raise BadRequest("Nodes: not an object (v1.NodeList)")
    items = nodes_obj.get("items")
    if items is None:
        return ExtenderArgs(pod, [], [])  # whole Nodes, none of them
    if not isinstance(items, simdjson.Array):
        raise BadRequest("Nodes.items: not a list")
    return ExtenderArgs(pod, _node_names(items), items)


def _kind(value: Any) -> str:
    return "list" if isinstance(value, simdjson.Array) else type(value).__name__


def _node_names(items: Any) -> list[str]:
    names = []
    for i, node in enumerate(items):
        metadata = node.get("metadata") if isinstance(node, simdjson.Object) else None
        name = metadata.get("name") if isinstance(metadata, simdjson.Object) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(f"Nodes.items[{i}].metadata.name: missing or not a string")
        names.append(name)
    return names


def _checked_pod(pod: dict[str, Any]) -> dict[str, Any]:
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        raise BadRequest("Pod.metadata: missing or not an object")
    for key in ("name", "namespace"):
        if not isinstance(metadata.get(key, ""), str):
            raise BadRequest(f"Pod.metadata.{key}: not a string")
    annotations = metadata.get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        raise BadRequest("Pod.metadata.annotations: not an object")
    spec = pod.get("spec")
    if spec is not None and not isinstance(spec, dict):
        raise BadRequest("Pod.spec: not an object")
    claims = (spec or {}).get("resourceClaims")
    if claims is not None:
        if not isinstance(claims, list):
            raise BadRequest("Pod.spec.resourceClaims: not a list")
        for i, claim in enumerate(claims):
            if not isinstance(claim, dict):
                raise BadRequest(f"Pod.spec.resourceClaims[{i}]: not an object")
            _check_claim_names(claim, f"Pod.spec.resourceClaims[{i}]")
    return pod


def _check_claim_names(claim: Mapping[str, Any], where: str) -> None:
    """A claim names its template or claim as a string, as the API server's schema demands."""
    for key in ("name", "resourceClaimName", "resourceClaimTemplateName"):
        value = claim.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{where}.{key}: not a string (got {_json_kind(value)} {clip(value, 40)})")
    source = claim.get("source")
    if source is not None:
        if not isinstance(source, dict):
            raise BadRequest(f"{where}.source: not an object")
        _check_claim_names(source, f"{where}.source")


def _json_kind(value: Any) -> str:
    kinds = {bool: "boolean", int: "number", float: "number", list: "list", dict: "object"}
    return kinds.get(type(value), type(value).__name__)


def claim_template_names(pod: Mapping[str, Any]) -> list[str]:
    """ResourceClaimTemplate names in pod.spec.resourceClaims (also the pre-1.31 `source` form)."""
    names = []
    for claim in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = claim.get("resourceClaimTemplateName")
        if not name and isinstance(claim.get("source"), dict):
            name = claim["source"].get("resourceClaimTemplateName")
        if isinstance(name, str) and name:
            names.append(name)
    return names


def size_hint(pod: Mapping[str, Any]) -> int | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(SIZE_ANNOTATION)
    if raw is None:
        return None
    try:
        size = int(str(raw).strip())
    except ValueError:
        raise BadRequest(
            f"Pod.metadata.annotations[{SIZE_ANNOTATION}]: not an integer: {clip(repr(raw))}"
        ) from None
    if size <= 0:
        raise BadRequest(f"Pod.metadata.annotations[{SIZE_ANNOTATION}]: must be > 0, got {size}")
    return size


def filter_result(
    args: ExtenderArgs,
    allowed: set[str] | frozenset[str] | None,
    failed: Mapping[str, str] | None = None,
    unresolvable: Mapping[str, str] | None = None,
    error: str = "",
) -> dict[str, Any]:
    """An ExtenderFilterResult in the form the request came in (Nodes or NodeNames)."""
    names = args.candidate_names
    keep = names if allowed is None else [n for n in names if n in allowed]
    result: dict[str, Any] = {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": dict(failed or {}),
        "FailedAndUnresolvableNodes": dict(unresolvable or {}),
        "Error": error,
    }
    if not args.whole_nodes:
        result["NodeNames"] = keep
    else:
        kept = set(keep)
        result["Nodes"] = {
            "metadata": {},
            # Spliced in as sent: re-encoding 500 Nodes would cost what parsing them did.
            "items": [orjson.Fragment(args.node_json(i)) for i, n in enumerate(names) if n in kept],
        }
    return result


class Extender:
    """The verbs, independent of HTTP: pod in, filter result / priorities out."""

    def __init__(
        self,
        placer: DomainPlacer,
        templates: TemplateDomainSource,
        sizes: DomainSizeSource,
        metrics: AdvisorMetrics | None = None,
    ) -> None:
        self.placer = placer
        self.templates = templates
        self.sizes = sizes
        self.metrics = metrics or placer.advisor.metrics

    async def domain_of(self, pod: Mapping[str, Any]) -> str | None:
        namespace = (pod.get("metadata") or {}).get("namespace") or "default"
        for template in claim_template_names(pod):
            uid = await self.templates.domain_of_template(namespace, template)
            if uid:
                return uid
        return None

    async def _size(self, domain_uid: str, pod: Mapping[str, Any]) -> int | None:
        hint = size_hint(pod)  # validated even when spec.numNodes wins
        return await self.sizes.num_nodes(domain_uid) or hint

    async def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        domain_uid = await self.domain_of(args.pod)
        if domain_uid is None:
            self.metrics.extender_requests.labels("filter", "passthrough").inc()
            return filter_result(args, None)
        if not self.placer.advisor.fleet.ready:
            self.metrics.extender_requests.labels("filter", "error").inc()
            return filter_result(args, set(), error="placement advisor inventory not synced yet")
        size = await self._size(domain_uid, args.pod)
        candidates = args.candidate_names
        allowance = await self.placer.allowed_nodes(domain_uid, size, candidates)
        rejected = {n: allowance.message for n in candidates if n not in allowance.allowed}
        self.metrics.extender_requests.labels("filter", "ours").inc()
        pod_meta = args.pod.get("metadata") or {}
        log.info(
            "filtered nodes for domain pod",
            cd_uid=domain_uid,
            namespace=pod_meta.get("namespace"),
            pod=pod_meta.get("name"),
            candidates=len(candidates),
            allowed=len(allowance.allowed),
            clique=",".join(allowance.cliques),
        )
        if allowance.resolvable:
            return filter_result(args, allowance.allowed, failed=rejected)
        return filter_result(args, allowance.allowed, unresolvable=rejected)

    async def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        candidates = args.candidate_names
        domain_uid = await self.domain_of(args.pod)
        if domain_uid is None:
            self.metrics.extender_requests.labels("prioritize", "passthrough").inc()
            return [{"Host": n, "Score": 0} for n in candidates]
        size = await self._size(domain_uid, args.pod)
        scores = self.placer.scores(domain_uid, size, candidates)
        self.metrics.extender_requests.labels("prioritize", "ours").inc()
        return [{"Host": n, "Score": scores.get(n, 0)} for n in candidates]


def _refusal(cls: type[web.HTTPClientError], message: str, **kwargs: Any) -> web.HTTPClientError:
    """A 4xx whose body is JSON, `{"Error": message}`, like ExtenderFilterResult's Error field."""
    return cls(text=orjson.dumps({"Error": message}).decode(), content_type="application/json", **kwargs)


def _json_response(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _join(prefix: str, verb: str) -> str:
    return "/" + "/".join(p for p in (prefix.strip("/"), verb.strip("/")) if p)


def build_extender_app(
    extender: Extender,
    prefix: str = "/",
    filter_verb: str = "filter",
    prioritize_verb: str = "prioritize",
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    read_timeout_s: float = 60.0,
) -> web.Application:
    """aiohttp app serving POST <prefix>/<filter_verb> and POST <prefix>/<prioritize_verb>."""

    async def read_args(request: web.Request, verb: str) -> ExtenderArgs:
        try:
            async with asyncio.timeout(read_timeout_s):
                body = await request.read()
        except TimeoutError:
            extender.metrics.extender_requests.labels(verb, "bad_request").inc()
            raise _refusal(
                web.HTTPRequestTimeout,
                f"request body not received within {read_timeout_s:g} s (--idle-timeout-s)",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            extender.metrics.extender_requests.labels(verb, "bad_request").inc()
            raise _refusal(
                web.HTTPRequestEntityTooLarge,
                f"request body is over {max_body_bytes} bytes, the limit (--extender-max-body-bytes)",
                max_size=max_body_bytes,
            ) from None
        try:
            return parse_args(body)
        except BadRequest as exc:
            extender.metrics.extender_requests.labels(verb, "bad_request").inc()
            log.warning("bad extender request", verb=verb, error=str(exc))
            raise _refusal(web.HTTPBadRequest, str(exc)) from None

    async def handle_filter(request: web.Request) -> web.Response:
        args = await read_args(request, "filter")
        try:
            result = await extender.filter(args)
        except BadRequest as exc:
            extender.metrics.extender_requests.labels("filter", "bad_request").inc()
            raise _refusal(web.HTTPBadRequest, str(exc)) from None
        except Exception as exc:
            extender.metrics.extender_requests.labels("filter", "error").inc()
            log.exception("extender filter failed")
            result = filter_result(args, set(), error=f"placement advisor: {type(exc).__name__}: {exc}")
        return _json_response(result)

    async def handle_prioritize(request: web.Request) -> web.Response:
        args = await read_args(request, "prioritize")
        try:
            priorities = await extender.prioritize(args)
        except BadRequest as exc:
            extender.metrics.extender_requests.labels("prioritize", "bad_request").inc()
            raise _refusal(web.HTTPBadRequest, str(exc)) from None
        except Exception:
            # kube-scheduler cannot do anything with a failed priority: neutral scores keep it going.
            extender.metrics.extender_requests.labels("prioritize", "error").inc()
            log.exception("extender prioritize failed")
            priorities = [{"Host": n, "Score": 0} for n in args.candidate_names]
        return _json_response(priorities)

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post(_join(prefix, filter_verb), handle_filter)
    app.router.add_post(_join(prefix, prioritize_verb), handle_prioritize)
    return app


class _CappedServer(web.Server):
    max_connections: int

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self.connections) > self.max_connections:
            log.warning("extender connection refused: too many open", limit=self.max_connections)
            # Closed once the handler's task has started: closing here would end it before it runs.
            asyncio.get_running_loop().call_soon(handler.force_close)


class CappedAppRunner(web.AppRunner):
    """An AppRunner whose server closes connections past `max_connections` as they arrive."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _CappedServer
        assert isinstance(server, _CappedServer)
        server.max_connections = self._max_connections
        return server
