"""Events about a FineTuneJob posted the way client-go's recorder does: the same event again within
EVENT_AGGREGATION_SECONDS bumps the count of the first one instead of adding an object (a flapping
pod cannot flood the API), and names sort in time order (the job's name and the nanosecond clock in
hex), so `kubectl describe` lists events of one second in the order they happened. Best effort: a
failed post is logged, never raised. (events.py moves the posting off the reconcile path.)
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from .. import api, lifecycle

# Named as when this code was shell/controller.py: log lines (and filters on them) keep their logger name.
log = logging.getLogger("finetune_operator.controller")

# The same event again within this time updates the first one's count (client-go: 10 minutes).
EVENT_AGGREGATION_SECONDS = 600.0
EVENT_MEMORY = 4096


class AggregatedEvents:
    """The events posted lately (their names and counts), to aggregate repeats into."""

    def __init__(self) -> None:
        self._events: dict[tuple[Any, ...], tuple[str, datetime, int]] = {}
        self._lock = threading.Lock()

    def post(self, core: client.CoreV1Api, job_body: dict[str, Any], event: lifecycle.Event) -> None:
        """Post `event` about the job through `core`, or bump the count of the same event posted
        within EVENT_AGGREGATION_SECONDS."""
        meta = job_body["metadata"]
        now = datetime.now(timezone.utc)
        message = event.message[:1024]
        key = (meta["namespace"], meta.get("uid"), event.type, event.reason, message)
        with self._lock:
            seen = self._events.get(key)
            if seen is not None and (now - seen[1]).total_seconds() < EVENT_AGGREGATION_SECONDS:
                name, first, count = seen
                try:
                    core.patch_namespaced_event(name, meta["namespace"], {
                        "count": count + 1, "lastTimestamp": now.isoformat().replace("+00:00", "Z")})
                    self._events[key] = (name, first, count + 1)
                    return
                except ApiException as error:
                    if error.status != 404:
                        log.warning("could not update event %s: %s", event.reason, error.reason)
                        return
            name = f"{meta['name']}.{time.time_ns():x}"
            body = client.CoreV1Event(
                metadata=client.V1ObjectMeta(name=name, namespace=meta["namespace"]),
                involved_object=client.V1ObjectReference(
                    api_version=api.API_VERSION, kind=api.KIND, name=meta["name"],
                    namespace=meta["namespace"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion")),
                type=event.type, reason=event.reason, message=message,
                first_timestamp=now, last_timestamp=now, count=1,
                source=client.V1EventSource(component="finetune-operator"),
                reporting_component="finetune.dev/operator", reporting_instance="finetune-operator",
                action=event.reason,
            )
            try:
                core.create_namespaced_event(meta["namespace"], body)
            except ApiException as error:  # events are best effort: never fail a reconcile for one
                log.warning("could not post event %s: %s", event.reason, error.reason)
                return
            self._events[key] = (name, now, 1)
            while len(self._events) > EVENT_MEMORY:
                self._events.pop(next(iter(self._events)))
