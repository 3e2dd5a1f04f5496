"""A strict stand-in for the parts of the Kubernetes API the operator's shell calls.

Strict like the API server where it matters for the invariants: a create of an existing
name is 409 AlreadyExists (never silently absorbed), a status write with a stale
resourceVersion is 409 Conflict, a delete with a uid precondition that does not match is
409, reads of missing objects are 404. Every write is logged, so tests can assert on what
the operator did (and did not do) to each object.

Lists and watches behave as the API server's do: a list carries the collection's
resourceVersion and pages (limit/continue, a consistent snapshot); a watch from a
resourceVersion replays every change after it, in order, as ADDED/MODIFIED/DELETED (an object
that starts or stops matching the selectors is ADDED/DELETED), ends with a BOOKMARK, and answers
an ERROR 410 event when `compact()` has dropped that history. A change that reached an object
without a new resourceVersion (a test editing a dict in place) fails the watch loudly instead of
being silently missed.

It stands in for `kubernetes.client.CoreV1Api`, `CustomObjectsApi`, `NetworkingV1Api` and
`ApiextensionsV1Api` (the methods `finetune_operator.shell.cluster.Cluster` and the informers use), so
the real `Cluster` and `Reconciler` run on top of it. End-to-end tests use the real API server; this is for fast property tests.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.rest import ApiException


@dataclass
class Response:
    data: bytes


def _response(obj: Any) -> Response:
    return Response(json.dumps(obj).encode())


def _error(status: int, reason: str, message: str) -> ApiException:
    error = ApiException(status=status, reason=reason)
    error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": reason, "message": message, "code": status})
    return error


# The API server's limit on a ConfigMap's data: the values' bytes (keys not counted), as the lab's
# kube-apiserver shows (e2e/test_lab_profile.py).
CONFIG_MAP_LIMIT = 1024 * 1024


def _refuse_invalid(kind: str, obj: dict[str, Any]) -> None:
    """What the API server's validation refuses and the operator can run into."""
    if kind == "ConfigMap":
        size = sum(len(value.encode()) for value in (obj.get("data") or {}).values())
        if size > CONFIG_MAP_LIMIT:
            raise _error(422, "Invalid", f'ConfigMap "{obj["metadata"]["name"]}" is invalid: []: Too long: '
                                         f"may not be more than {CONFIG_MAP_LIMIT} bytes")


def _plain(body: Any) -> Any:
    """A kubernetes client model (V1DeleteOptions, CoreV1Event) or a dict, as a dict."""
    if body is None or isinstance(body, dict):
        return body
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(body)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386): null deletes a key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.split(","):
        if "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term and term not in labels:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def _fields_match(obj: dict[str, Any], selector: str | None) -> bool:
    """A field selector: `path=value`, `path==value`, `path!=value`, comma-separated (all must hold)."""
    for term in (selector or "").split(","):
        if not term:
            continue
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _field(obj, path) == value:
                return False
        else:
            path, value = term.replace("==", "=").split("=", 1)
            if _field(obj, path) != value:
                return False
    return True


class WatchResponse:
    """A watch's HTTP response: JSON lines, as `kubernetes.watch.iter_resp_lines` reads them."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.closed = False

    def stream(self, amt=None, decode_content=False):
        for event in self.events:
            if self.closed:
                return
            yield (json.dumps(event) + "\n").encode()

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        pass


@dataclass
class Write:
    verb: str  # create | delete | patch | status | status-patch
    kind: str
    namespace: str
    name: str
    body: Any = None
    before: Any = None  # the object as it was, for patches


@dataclass
class FakeKube:
    """The object store; `core` and `custom` are the two API facades over it."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    writes: list[Write] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    # Fault injection: fail the n-th write from now with this exception (an operator killed
    # mid-reconcile, an API server that goes away), or refuse creates of a kind (a webhook).
    fail_after_writes: int | None = None
    fail_with: Exception | None = None
    refuse_create: dict[str, ApiException] = field(default_factory=dict)
    # Kinds whose list the API refuses (RBAC): kind -> the error a list of it raises.
    refuse_list: dict[str, ApiException] = field(default_factory=dict)
    # Container logs, as the kubelet keeps them: (namespace, pod, container) -> [(unix time, line)];
    # `log_clock` is "now" for sinceSeconds. `log_reads` records every pods/log request.
    logs: dict[tuple[str, str, str], list[tuple[float, str]]] = field(default_factory=dict)
    log_clock: Any = None
    log_reads: list[dict[str, Any]] = field(default_factory=list)
    # The custom resources the API server serves (API discovery); 404 for the others, as a real
    # API server answers for a kind whose CRD is not installed.
    served: set[str] = field(default_factory=lambda: {"pytorchjobs", "finetunejobs"})
    _rv: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Every change as a watch replays it: (resourceVersion, type, kind, object after (the last state
    # for DELETED), object before or None). History at or before `compacted` is gone (410).
    history: list[tuple[int, str, str, dict[str, Any], dict[str, Any] | None]] = field(default_factory=list)
    compacted: int = 0
    resource_version: int = 0
    watch_requests: list[dict[str, Any]] = field(default_factory=list)
    _last: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    _pages: dict[str, tuple[list[dict[str, Any]], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.core = _Core(self)
        self.custom = _Custom(self)
        self.networking = _Networking(self)
        self.extensions = _Extensions(self)

    # -- store ---------------------------------------------------------------
    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as a test (not the operator) would: no write logged."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        key = (kind, meta["namespace"], meta["name"])
        before = self._last.get(key)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = obj
        self._record("MODIFIED" if before is not None else "ADDED", key, obj, before)
        return obj

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def install_crd(self, plural: str) -> dict[str, Any]:
        """Install the CRD of a kind, as its operator's chart would: the API server then serves the kind
        (API discovery) and a watch of CRDs sees it ADDED, Established."""
        group, version = _GROUPS[plural]
        self.served.add(plural)
        return self.put("CustomResourceDefinition", {
            "metadata": {"name": f"{plural}.{group}", "namespace": ""},
            "spec": {"group": group, "names": {"plural": plural, "kind": _PLURALS[plural]},
                     "versions": [{"name": version, "served": True, "storage": True}]},
            "status": {"conditions": [{"type": "Established", "status": "True"}]}})

    def remove_crd(self, plural: str) -> None:
        """Uninstall it: the kind is no longer served (its objects go with it, not modelled here)."""
        self.served.discard(plural)
        self.remove("CustomResourceDefinition", "", f"{plural}.{_GROUPS[plural][0]}")

    def of_kind(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [o for (k, ns, _), o in sorted(self.objects.items()) if k == kind and namespace in (None, ns)]

    def touch(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = self._next_rv()
        key = next(k for k, o in self.objects.items() if o is obj)
        self._record("MODIFIED", key, obj, self._last.get(key))

    def _next_rv(self) -> str:
        self.resource_version = next(self._rv)
        return str(self.resource_version)

    def _record(self, kind_of_event: str, key: tuple[str, str, str], obj: dict[str, Any],
                before: dict[str, Any] | None) -> None:
        after = copy.deepcopy(obj)
        self.history.append((int(obj["metadata"]["resourceVersion"]), kind_of_event, key[0], after, before))
        if kind_of_event == "DELETED":
            self._last.pop(key, None)
        else:
            self._last[key] = after

    def remove(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object as a test (a person, the garbage collector) would: no write logged."""
        key = (kind, namespace, name)
        obj = self.objects.pop(key)
        last = copy.deepcopy(obj)
        last["metadata"]["resourceVersion"] = self._next_rv()
        self._record("DELETED", key, last, self._last.get(key))

    def compact(self) -> None:
        """Drop the change history, as etcd compaction does: a watch from an older resourceVersion gets 410."""
        self.compacted = self.resource_version
        self.history = [h for h in self.history if h[0] > self.compacted]

    # -- lists and watches -------------------------------------------------------
    def list_or_watch(self, kind: str, namespace: str | None, *, label_selector: str | None = None,
                      field_selector: str | None = None, watch: bool = False, resource_version: str | None = None,
                      limit: int | None = None, _continue: str | None = None, allow_watch_bookmarks: bool = False,
                      timeout_seconds: int | None = None, **_: Any) -> Any:
        def selected(obj: dict[str, Any] | None) -> bool:
            return (obj is not None and namespace in (None, obj["metadata"].get("namespace", ""))
                    and _matches(obj, label_selector) and _fields_match(obj, field_selector))

        if watch:
            return self._watch(kind, selected, resource_version, allow_watch_bookmarks, label_selector, field_selector)
        if _continue:
            if _continue not in self._pages:
                raise _error(410, "Expired", "the provided continue parameter is too old")
            items, version = self._pages.pop(_continue)
        else:
            items, version = [o for o in self.of_kind(kind, namespace) if selected(o)], self.resource_version
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if limit and len(items) > limit:
            token = str(uuid.uuid4())
            self._pages[token] = (items[limit:], version)
            items, meta["continue"] = items[:limit], token
        return _response({"metadata": meta, "items": items})

    def _watch(self, kind: str, selected: Any, resource_version: str | None, bookmarks: bool,
               label_selector: str | None, field_selector: str | None) -> WatchResponse:
        self.watch_requests.append({"kind": kind, "resourceVersion": resource_version,
                                    "labelSelector": label_selector, "fieldSelector": field_selector})
        for key, obj in self.objects.items():
            if self._last.get(key) != obj:
                raise AssertionError(f"{key} changed without a new resourceVersion: a watch would never see it")
        for key in self._last:
            if key not in self.objects:
                raise AssertionError(f"{key} was removed without a DELETED event: use FakeKube.remove")
        events: list[dict[str, Any]] = []
        if resource_version in (None, "", "0"):  # "any": the current state as ADDED, then what follows
            events = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self.of_kind(kind) if selected(o)]
        elif int(resource_version) < self.compacted:
            return WatchResponse([{"type": "ERROR", "object": {
                "kind": "Status", "status": "Failure", "reason": "Expired", "code": 410,
                "message": f"too old resource version: {resource_version} ({self.compacted})"}}])
        else:
            for version, type_, kind_of, after, before in self.history:
                if kind_of != kind or version <= int(resource_version):
                    continue
                was, now = selected(before), selected(after) and type_ != "DELETED"
                if type_ == "DELETED":
                    was = was or selected(after)
                if was and now:
                    events.append({"type": "MODIFIED", "object": copy.deepcopy(after)})
                elif now:
                    events.append({"type": "ADDED", "object": copy.deepcopy(after)})
                elif was:
                    events.append({"type": "DELETED", "object": copy.deepcopy(after)})
        if bookmarks:
            events.append({"type": "BOOKMARK", "object": {"kind": kind,
                                                          "metadata": {"resourceVersion": str(self.resource_version)}}})
        return WatchResponse(events)

    def _write(self, write: Write) -> None:
        if self.fail_after_writes is not None:
            if self.fail_after_writes == 0:
                self.fail_after_writes = None
                raise self.fail_with or RuntimeError("the operator was killed")
            self.fail_after_writes -= 1
        self.writes.append(write)

    def _must_get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.get(kind, namespace, name)
        if obj is None:
            raise _error(404, "NotFound", f'{kind} "{name}" not found')
        return obj

    def _create(self, kind: str, namespace: str, body: Any) -> Response:
        body = copy.deepcopy(_plain(body))
        name = body["metadata"]["name"]
        if kind in self.refuse_create:
            raise self.refuse_create[kind]
        if self.get(kind, namespace, name) is not None:
            raise _error(409, "AlreadyExists", f'{kind} "{name}" already exists')
        if body["metadata"].get("namespace") not in (None, namespace):  # as the API server refuses it
            raise _error(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        _refuse_invalid(kind, body)
        self._write(Write("create", kind, namespace, name, body))
        body["metadata"]["namespace"] = namespace
        body["metadata"].pop("uid", None)
        return _response(self.put(kind, body))

    def _delete(self, kind: str, namespace: str, name: str, options: Any) -> None:
        obj = self._must_get(kind, namespace, name)
        options = _plain(options) or {}
        wanted = (options.get("preconditions") or {}).get("uid")
        if wanted is not None and wanted != obj["metadata"]["uid"]:
            raise _error(409, "Conflict", f"precondition failed: uid {wanted} != {obj['metadata']['uid']}")
        self._write(Write("delete", kind, namespace, name))
        self.remove(kind, namespace, name)
        if kind in ("PyTorchJob", "TrainJob"):  # the garbage collector takes its pods
            for key, pod in list(self.objects.items()):
                if key[0] == "Pod" and any(r.get("uid") == obj["metadata"]["uid"]
                                           for r in pod["metadata"].get("ownerReferences") or []):
                    self.remove(*key)

    def _json_patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]], *, status: bool) -> Response:
        """JSON patch (RFC 6902) as the API server applies it: all or nothing; a failed `test` is 422.
        On the status subresource only /status may change."""
        obj = self._must_get(kind, namespace, name)
        patched = copy.deepcopy(obj)
        for op in ops:
            *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
            if status and (not parents and last != "status" or parents and parents[0] != "status"):
                raise _error(422, "Invalid", f"only status may be patched here, not {op['path']}")
            target = patched
            for part in parents:
                if not isinstance(target, dict) or part not in target:
                    raise _error(422, "Invalid", f"path {op['path']} does not exist")
                target = target[part]
            if op["op"] == "test":
                if not isinstance(target, dict) or target.get(last, object()) != op["value"]:
                    raise _error(422, "Invalid", f"testing value {op['path']} failed")
            elif op["op"] in ("add", "replace"):
                if op["op"] == "replace" and last not in target:
                    raise _error(422, "Invalid", f"replace of missing {op['path']}")
                target[last] = copy.deepcopy(op["value"])
            elif op["op"] == "remove":
                if last not in target:
                    raise _error(422, "Invalid", f"remove of missing {op['path']}")
                del target[last]
            else:
                raise _error(422, "Invalid", f"unsupported JSON patch op {op['op']!r}")
        self._write(Write("status-patch" if status else "patch", kind, namespace, name, copy.deepcopy(ops),
                          before=copy.deepcopy(obj)))
        obj.clear()
        obj.update(patched)
        self.touch(obj)
        return _response(obj)

    def _patch(self, kind: str, namespace: str, name: str, body: dict[str, Any], *, status: bool) -> Response:
        obj = self._must_get(kind, namespace, name)
        wanted = ((body.get("metadata") or {}).get("resourceVersion"))
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified")
        patch = copy.deepcopy(body)
        if status:
            patch = {"status": patch.get("status") or {}}
        else:
            patch.pop("status", None)
            (patch.get("metadata") or {}).pop("resourceVersion", None)
        if kind == "ConfigMap":  # validated as it would be after the patch, before anything changes
            merged = copy.deepcopy(obj)
            _merge(merged, patch)
            _refuse_invalid(kind, merged)
        self._write(Write("status-patch" if status else "patch", kind, namespace, name, copy.deepcopy(body),
                          before=copy.deepcopy(obj)))
        _merge(obj, patch)
        self.touch(obj)
        return _response(obj)


_PLURALS = {"pytorchjobs": "PyTorchJob", "finetunejobs": "FineTuneJob", "trainjobs": "TrainJob",
            "workloads": "Workload", "localqueues": "LocalQueue", "clustertrainingruntimes": "ClusterTrainingRuntime"}
_GROUPS = {"pytorchjobs": ("kubeflow.org", "v1"), "finetunejobs": ("finetune.dev", "v1alpha1"),
           "trainjobs": ("trainer.kubeflow.org", "v1alpha1"), "workloads": ("kueue.x-k8s.io", "v1beta2"),
           "localqueues": ("kueue.x-k8s.io", "v1beta2"),
           "clustertrainingruntimes": ("trainer.kubeflow.org", "v1alpha1")}


class _Custom:
    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    def _served(self, group, version, plural) -> None:
        if plural not in self.kube.served or _GROUPS[plural] != (group, version):
            raise _error(404, "NotFound", f"the server could not find the requested resource ({plural}.{group})")

    def get_api_resources(self, group, version, **_):
        names = [p for p in sorted(self.kube.served) if _GROUPS[p] == (group, version)]
        if not names:
            raise _error(404, "NotFound", f"the server could not find the requested resource ({group}/{version})")
        return _response({"kind": "APIResourceList", "groupVersion": f"{group}/{version}",
                          "resources": [{"name": p, "kind": _PLURALS[p], "namespaced": True} for p in names]})

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        self._served(group, version, plural)
        return _response(self.kube._must_get(_PLURALS[plural], namespace, name))

    def get_cluster_custom_object(self, group, version, plural, name, **_):
        self._served(group, version, plural)
        return _response(self.kube._must_get(_PLURALS[plural], "", name))

    def list_namespaced_custom_object(self, group, version, namespace, plural, **kwargs):
        self._served(group, version, plural)
        if _PLURALS[plural] in self.kube.refuse_list:
            raise self.kube.refuse_list[_PLURALS[plural]]
        return self.kube.list_or_watch(_PLURALS[plural], namespace, **kwargs)

    def list_cluster_custom_object(self, group, version, plural, **kwargs):
        self._served(group, version, plural)
        return self.kube.list_or_watch(_PLURALS[plural], None, **kwargs)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        self._served(group, version, plural)
        return self.kube._create(_PLURALS[plural], namespace, body)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None, **_):
        self.kube._delete(_PLURALS[plural], namespace, name, body)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **_):
        return self.kube._patch(_PLURALS[plural], namespace, name, body, status=False)

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, _content_type=None, **_):
        if isinstance(body, list):
            # The client sends a merge patch unless told otherwise; a list is not a merge patch.
            if _content_type != "application/json-patch+json":
                raise _error(400, "BadRequest", "a JSON patch (a list) needs _content_type application/json-patch+json")
            return self.kube._json_patch(_PLURALS[plural], namespace, name, body, status=True)
        return self.kube._patch(_PLURALS[plural], namespace, name, body, status=True)

    def replace_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **_):
        kind = _PLURALS[plural]
        obj = self.kube._must_get(kind, namespace, name)
        if body["metadata"].get("resourceVersion") != obj["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified; please apply your changes to the latest version")
        self.kube._write(Write("status", kind, namespace, name, copy.deepcopy(body.get("status"))))
        obj["status"] = copy.deepcopy(body.get("status"))
        self.kube.touch(obj)
        return _response(obj)


class _Networking:
    """NetworkingV1Api: the attempts' NetworkPolicies."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    def read_namespaced_network_policy(self, name, namespace, **_):
        return _response(self.kube._must_get("NetworkPolicy", namespace, name))

    def create_namespaced_network_policy(self, namespace, body, **_):
        return self.kube._create("NetworkPolicy", namespace, body)

    def delete_namespaced_network_policy(self, name, namespace, body=None, **_):
        self.kube._delete("NetworkPolicy", namespace, name, body)

    def list_namespaced_network_policy(self, namespace, **kwargs):
        return self.kube.list_or_watch("NetworkPolicy", namespace, **kwargs)


class _Extensions:
    """ApiextensionsV1Api: CustomResourceDefinitions, listed and watched (cluster-scoped)."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    def list_custom_resource_definition(self, **kwargs):
        # The API server's field selectors on CRDs: metadata.name and metadata.namespace only.
        for term in (kwargs.get("field_selector") or "").split(","):
            if term and term.replace("!=", "=").split("=", 1)[0] not in ("metadata.name", "metadata.namespace"):
                raise _error(400, "BadRequest", f'"{term}" is not a known field selector')
        return self.kube.list_or_watch("CustomResourceDefinition", None, **kwargs)


class _Core:
    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    def list_namespaced_pod(self, namespace, **kwargs):
        return self.kube.list_or_watch("Pod", namespace, **kwargs)

    def list_pod_for_all_namespaces(self, **kwargs):
        return self.kube.list_or_watch("Pod", None, **kwargs)

    def list_node(self, **kwargs):
        return self.kube.list_or_watch("Node", None, **kwargs)

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, limit_bytes=None,
                                since_seconds=None, _preload_content=True, **_):
        """pods/log like the API server and kubelet: 404 for a missing pod, 400 without a container
        name on a pod of several, for a container the pod does not have, or one not started yet;
        then sinceSeconds, tailLines, limitBytes in that order."""
        pod = self.kube._must_get("Pod", namespace, name)
        self.kube.log_reads.append({"pod": name, "container": container, "tailLines": tail_lines,
                                    "limitBytes": limit_bytes, "sinceSeconds": since_seconds})
        names = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        if container is None:
            if len(names) != 1:
                raise _error(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: {names}")
            container = names[0]
        if container not in names:
            raise _error(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if (pod.get("status") or {}).get("phase") in (None, "Pending"):
            raise _error(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        lines = list(self.kube.logs.get((namespace, name, container), []))
        if since_seconds is not None:
            import time as _time
            now = (self.kube.log_clock or _time.time)()
            lines = [(t, line) for t, line in lines if t >= now - since_seconds]
        if tail_lines is not None:
            lines = lines[-tail_lines:] if tail_lines > 0 else []
        data = "".join(line + "\n" for _, line in lines).encode()
        if limit_bytes is not None:
            data = data[:limit_bytes]
        if _preload_content:
            return data.decode()
        return Response(data)

    def read_namespaced_config_map(self, name, namespace, **_):
        return _response(self.kube._must_get("ConfigMap", namespace, name))

    def patch_namespaced_config_map(self, name, namespace, body, **_):
        return self.kube._patch("ConfigMap", namespace, name, body, status=False)

    def read_namespaced_pod(self, name, namespace, **_):
        return _response(self.kube._must_get("Pod", namespace, name))

    def create_namespaced_pod(self, namespace, body, **_):
        return self.kube._create("Pod", namespace, body)

    def delete_namespaced_pod(self, name, namespace, body=None, **_):
        self.kube._delete("Pod", namespace, name, body)

    def create_namespaced_config_map(self, namespace, body, **_):
        return self.kube._create("ConfigMap", namespace, body)

    def delete_namespaced_config_map(self, name, namespace, body=None, **_):
        self.kube._delete("ConfigMap", namespace, name, body)

    def create_namespaced_event(self, namespace, body, **_):
        body = _plain(body)
        if self.kube.get("Event", namespace, body["metadata"]["name"]) is not None:
            raise _error(409, "AlreadyExists", f'Event "{body["metadata"]["name"]}" already exists')
        self.kube.events.append(body)
        self.kube.put("Event", body)

    def patch_namespaced_event(self, name, namespace, body, **_):
        return self.kube._patch("Event", namespace, name, body, status=False)


class Serialised:
    """One of the facades (`core`, `custom`, `networking`) for callers on several threads: each call
    runs alone under `lock` (shared by the facades of one FakeKube: the store is not thread safe, and
    the API server orders its writes too), after `latency` seconds outside it, as a round trip waits
    on the network with the GIL released."""

    def __init__(self, facade: Any, lock: Any, latency: float = 0.0) -> None:
        self._facade, self._lock, self._latency = facade, lock, latency

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._facade, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._latency:
                time.sleep(self._latency)
            with self._lock:
                return method(*args, **kwargs)

        return call
