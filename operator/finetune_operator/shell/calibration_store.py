"""The learned memory calibration, stored: the ConfigMap `finetune-operator-calibration` in the
operator's namespace, one key per kind of run (calibration.Kind.key) holding its Learned factor as
JSON. The rule is calibration.py's; this is the I/O (read per reconcile, cached briefly; written as a
JSON merge patch of the keys a decision changed) and the metric that shows it."""

from __future__ import annotations

import time
from typing import Any, Callable

from . import metrics
from ..calibration import Learned, read_table
from .profiling import merge_into_config_map

CALIBRATION_CONFIGMAP = "finetune-operator-calibration"
READ_CACHE_SECONDS = 5.0


class CalibrationStore:
    def __init__(self, cluster: Any, namespace: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.clock = clock
        self._table: dict[str, Learned] | None = None
        self._read_at = 0.0

    def read(self) -> dict[str, Learned]:
        if self._table is None or self.clock() - self._read_at > READ_CACHE_SECONDS:
            config_map = self.cluster.get_config_map(self.namespace, CALIBRATION_CONFIGMAP)
            self._table = read_table((config_map or {}).get("data"))
            self._read_at = self.clock()
            metrics.show_calibration(self._table)
        return dict(self._table)

    def write(self, changed: dict[str, Learned]) -> None:
        if not changed:
            return
        data = merge_into_config_map(self.cluster, self.namespace, CALIBRATION_CONFIGMAP,
                                     {k: v.to_json() for k, v in changed.items()}, "calibration")
        self._table = read_table(data)
        self._read_at = self.clock()
        metrics.show_calibration(self._table)
