"""The last state of training pods that failed, were disrupted or were deleted before they ended,
kept until a reconcile has written it into the job's status: whoever deletes such a pod (an
eviction, a cleanup policy, a person) must not take the reason for the failure with it. Fed by the
pod watch (`Cluster.remember_failed_pod`), read with the job's pods (`Cluster.list_job_pods`).
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

from ..rendering.labels import ATTEMPT_LABEL, JOB_LABEL

# Attempts whose failed pods are remembered (oldest forgotten first).
FAILED_POD_MEMORY = 512


class FailedPods:
    """Failed pods by (namespace, job label, attempt label), then by pod name."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def remember(self, pod: dict[str, Any], *, deleted: bool = False) -> None:
        """Keep `pod` (a watch event's; `deleted`: a DELETED event) if it failed, was disrupted or
        was deleted before it ended; any other pod is not kept."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        phase = (pod.get("status") or {}).get("phase")
        if deleted and phase not in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"):
            # A watch's DELETED event of a force-deleted pod may carry no deletionTimestamp.
            pod = dict(pod, metadata=dict(meta, deletionTimestamp=datetime.now(timezone.utc).isoformat()))
            meta = pod["metadata"]
        if not (_has_failed_container(pod) or _disrupted(pod)
                or (meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed"))):
            return
        key = (meta.get("namespace", ""), labels.get(JOB_LABEL, ""), labels.get(ATTEMPT_LABEL, ""))
        with self._lock:
            self._pods.setdefault(key, {})[meta.get("name", "")] = pod
            while len(self._pods) > FAILED_POD_MEMORY:
                self._pods.pop(next(iter(self._pods)))

    def gone(self, namespace: str, job_label: str, present: set[str]) -> list[dict[str, Any]]:
        """The remembered pods of the job (its label value) whose names are not in `present`."""
        with self._lock:
            return [p for (ns, label, _), by_name in self._pods.items() if (ns, label) == (namespace, job_label)
                    for pod_name, p in by_name.items() if pod_name not in present]


def _disrupted(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _has_failed_container(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return True
    for container in status.get("containerStatuses") or []:
        for key in ("state", "lastState"):
            terminated = (container.get(key) or {}).get("terminated") or {}
            if terminated.get("exitCode") not in (None, 0):
                return True
    return False
