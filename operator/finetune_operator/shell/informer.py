"""An informer: one kind listed once, then watched, into an indexed store in memory.

The shell used to list a job's pods and training jobs on every reconcile, and every node and
running pod of the cluster every few seconds to count free GPUs. At a thousand jobs that is a
thousand label-selected lists per wave of reconciles, and a cluster-wide pod list the API server
serves from etcd. Here each kind is listed once (in pages) and then watched from the list's
resourceVersion, as client-go's reflector does; the objects live in a store indexed by what the
reconciler asks for (the job a pod or training job belongs to), so a reconcile reads memory and
costs O(the job's objects), and the API server sees one watch per kind. Every watch of the
operator is one of these (informers.py says which), on the one bounded client of apiclient.py.

Strict about what a watch promises:
  - every event moves the store forward and remembers the resourceVersion it came with;
    BOOKMARK events move only the resourceVersion;
  - a watch that ends (the server's timeout) continues from the last resourceVersion;
  - "410 Gone" (the resourceVersion was compacted away), in the response or as an ERROR event,
    means events were lost: the informer lists again and replaces the store, and reports every
    object that vanished meanwhile as DELETED (with its last known state), so nothing is dropped
    silently;
  - the API server away (connection errors, 5xx): backoff with jitter, one log line per outage.
`on_change(type, obj)` runs after the store holds the change, so work it queues reads at least
that state. Objects the operator itself writes are put in the store at once (`note_written`,
`note_deleted`): its next reconcile must not miss a child it has just created.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, Hashable, Iterable

import urllib3
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .apiclient import WATCH_SECONDS, watch_timeout

log = logging.getLogger("finetune_operator.informers")

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
Obj = dict[str, Any]

PAGE_SIZE = 500
BACKOFF_MIN_SECONDS, BACKOFF_MAX_SECONDS = 0.2, 10.0
TRANSIENT = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError)


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def slim(obj: Obj) -> Obj:
    """The object without managedFields (often half its size; the operator never reads them)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = dict(obj, metadata={k: v for k, v in meta.items() if k != "managedFields"})
    return obj


class Informer:
    """One kind (with its selectors), listed and watched into an indexed store.

    `list_fn` is a client list method (`CoreV1Api.list_node`, or a `functools.partial` of
    `CustomObjectsApi.list_cluster_custom_object` with group, version and plural) that accepts
    `watch`, `resource_version`, `limit`, `_continue` and `_preload_content`.
    `project(obj)` keeps what the operator reads (None: do not store the object at all);
    `index(obj)` names the bucket `indexed()` returns it in (None: no bucket).
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], *, selectors: dict[str, str] | None = None,
                 project: Callable[[Obj], Obj | None] = slim, index: Callable[[Obj], Hashable | None] | None = None,
                 on_change: Callable[[str, Obj], None] | None = None, page_size: int = PAGE_SIZE,
                 watch_seconds: int = WATCH_SECONDS) -> None:
        self.name = name
        self.list_fn = list_fn
        self.selectors = dict(selectors or {})
        self.project = project
        self.index = index
        self.on_change = on_change
        self.page_size = page_size
        self.watch_seconds = watch_seconds
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.version = 0  # bumped on every change of the store, for caches derived from it
        self.relists = 0
        self._store: dict[Key, Obj] = {}
        self._buckets: dict[Hashable, dict[Key, Obj]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._response: Any = None

    # -- reading ---------------------------------------------------------------
    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self._store.get((namespace, name))

    def items(self) -> list[Obj]:
        with self._lock:
            return list(self._store.values())

    def indexed(self, bucket: Hashable) -> list[Obj]:
        with self._lock:
            return list(self._buckets.get(bucket, {}).values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    # -- the operator's own writes -----------------------------------------------
    def note_written(self, obj: Obj) -> None:
        """An object the operator created or changed, as the API server answered: in the store now,
        before its watch event arrives (which replaces it with the same or a later state)."""
        self._apply("MODIFIED", obj, notify=False)

    def note_deleted(self, namespace: str, name: str) -> None:
        with self._lock:
            old = self._store.get((namespace, name))
        if old is not None:
            self._apply("DELETED", old, notify=False)

    # -- the loop --------------------------------------------------------------
    def start(self) -> "Informer":
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()
        return self

    def dead(self) -> bool:
        """Started, not stopped, and its thread is gone: its store would never change again."""
        thread = self._thread
        return thread is not None and not self._stop.is_set() and not thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Shut the socket down first: the watch thread blocks in a read holding the response's
            # buffer lock, so close() alone waits for the next event or the watch's timeout.
            sock = getattr(getattr(response, "connection", None), "sock", None)
            if sock is not None:
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass
            try:
                response.close()
            except Exception:  # closing a socket another thread reads: best effort
                pass

    def run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.step()
                if failures:
                    log.info("%s: watching again", self.name)
                failures = 0
            except Gone:
                continue  # step() has dropped the resourceVersion: the next step lists
            except (ApiException, *TRANSIENT) as error:
                if self._stop.is_set():
                    break  # stop() cut the watch's connection
                failures += 1
                if failures == 1:
                    log.warning("%s: %s; retrying with backoff", self.name, _short(error))
                delay = min(BACKOFF_MAX_SECONDS, BACKOFF_MIN_SECONDS * 2 ** min(failures, 8))
                self._stop.wait(delay * random.uniform(0.5, 1.0))
            except Exception:  # a bug: keep the informer alive, but say so loudly
                log.exception("%s: unexpected error; listing again", self.name)
                self.resource_version = None
                self._stop.wait(BACKOFF_MAX_SECONDS)

    def step(self) -> None:
        """List (first time, or after 410 Gone) or watch once until the server ends the watch."""
        if self.resource_version is None:
            self.list()
        else:
            self.watch()

    def list(self) -> None:
        """List every page and replace the store; what vanished is reported DELETED."""
        items: list[Obj] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = dict(self.selectors, limit=self.page_size, _preload_content=False)
            if token:
                kwargs["_continue"] = token
            try:
                page = json.loads(self.list_fn(**kwargs).data)
            except ApiException as error:
                if error.status == 410 and token:  # the continue token expired: start over
                    items, token = [], None
                    continue
                raise
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        fresh: dict[Key, Obj] = {}
        for raw in items:
            obj = self.project(raw)
            if obj is not None:
                fresh[key_of(raw)] = obj
        with self._lock:
            old = self._store
            self._store = fresh
            self._buckets = {}
            for k, obj in fresh.items():
                self._bucket_add(k, obj)
            self.resource_version = str(meta.get("resourceVersion") or "") or None
            self.version += 1
            self.relists += 1
        self.synced.set()
        if self.on_change is not None:
            for k, obj in old.items():
                if k not in fresh:
                    self._notify("DELETED", obj)
            for k, obj in fresh.items():
                if old.get(k) != obj:
                    self._notify("ADDED" if k not in old else "MODIFIED", obj)

    def watch(self) -> None:
        kwargs = dict(self.selectors, watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
                      timeout_seconds=self.watch_seconds, _preload_content=False,
                      _request_timeout=watch_timeout(self.watch_seconds).as_request_timeout())
        try:
            response = self.list_fn(**kwargs)
        except ApiException as error:
            if error.status == 410:
                self._gone()
            raise
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        self._gone()
                    raise ApiException(status=obj.get("code") or 500, reason=f"{obj.get('reason')}: {obj.get('message')}")
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply(kind, obj)
                elif kind != "BOOKMARK":
                    raise ApiException(status=500, reason=f"unknown watch event type {kind!r}")
                if version:
                    self.resource_version = str(version)
                if self._stop.is_set():
                    return
        finally:
            self._response = None
            try:
                response.close()
                response.release_conn()
            except Exception:
                pass

    # -- the store -------------------------------------------------------------
    def _gone(self) -> None:
        log.info("%s: resourceVersion %s is gone; listing again", self.name, self.resource_version)
        self.resource_version = None
        raise Gone()

    def _apply(self, kind: str, raw: Obj, *, notify: bool = True) -> None:
        k = key_of(raw)
        projected = self.project(raw)
        obj = projected if kind != "DELETED" else None
        with self._lock:
            old = self._store.get(k)
            if old is not None:
                self._bucket_remove(k, old)
            if obj is None:
                self._store.pop(k, None)
            else:
                self._store[k] = obj
                self._bucket_add(k, obj)
            self.version += 1
        if not notify:
            return
        if kind == "DELETED":
            last = projected if projected is not None else old  # a DELETED event carries the last state
            if last is not None:
                self._notify("DELETED", last)
        elif obj is not None:
            self._notify(kind, obj)
        elif old is not None:  # no longer kept (the projection dropped it): gone, as far as readers see
            self._notify("DELETED", old)

    def _notify(self, kind: str, obj: Obj) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(kind, obj)
        except Exception:
            log.exception("%s: a change handler failed", self.name)

    def _bucket_add(self, k: Key, obj: Obj) -> None:
        if self.index is not None:
            bucket = self.index(obj)
            if bucket is not None:
                self._buckets.setdefault(bucket, {})[k] = obj

    def _bucket_remove(self, k: Key, obj: Obj) -> None:
        if self.index is not None:
            bucket = self.index(obj)
            if bucket is not None:
                members = self._buckets.get(bucket)
                if members is not None:
                    members.pop(k, None)
                    if not members:
                        del self._buckets[bucket]


def wait_synced(informers: Iterable[Informer], timeout: float) -> bool:
    """Whether every informer has listed once, within `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    return all(i.synced.wait(max(0.0, deadline - time.monotonic())) for i in informers)


def _short(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"API error {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
