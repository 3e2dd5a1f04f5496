"""What `Cluster` remembers between reconciles (no cluster): the pods that failed, after they are gone."""

from __future__ import annotations


def test_failed_pods_are_remembered_after_they_are_gone():
    from unittest import mock

    from finetune_operator.shell.cluster import Cluster

    cluster = Cluster(mock.MagicMock())
    cluster.core = mock.MagicMock()
    failed = {"metadata": {"name": "j-a1-master-0", "namespace": "ns",
                           "labels": {"finetune.dev/job": "j", "finetune.dev/attempt": "1"}},
              "status": {"phase": "Failed", "containerStatuses": [
                  {"name": "pytorch", "state": {"terminated": {"exitCode": 75, "message": "{}"}}}]}}
    running = {"metadata": {"name": "j-a1-worker-0", "namespace": "ns",
                            "labels": {"finetune.dev/job": "j", "finetune.dev/attempt": "1"}},
               "status": {"phase": "Running"}}
    cluster.remember_failed_pod(failed)
    cluster.remember_failed_pod(running)  # not failed: not kept
    response = mock.MagicMock()
    response.data = b'{"items": []}'
    cluster.core.list_namespaced_pod.return_value = response
    assert [p["metadata"]["name"] for p in cluster.list_job_pods("ns", "j")] == ["j-a1-master-0"]
    assert cluster.list_job_pods("ns", "other") == []


def test_a_running_pod_deleted_is_remembered_even_without_a_deletion_timestamp():
    from unittest import mock

    from finetune_operator.shell.cluster import Cluster

    cluster = Cluster(mock.MagicMock())
    running = {"metadata": {"name": "j-a1-master-0", "namespace": "ns",
                            "labels": {"finetune.dev/job": "j", "finetune.dev/attempt": "1"}},
               "status": {"phase": "Running"}}
    cluster.remember_failed_pod(running)  # an update of a running pod: nothing to keep
    response = mock.MagicMock()
    response.data = b'{"items": []}'
    cluster.core = mock.MagicMock()
    cluster.core.list_namespaced_pod.return_value = response
    assert cluster.list_job_pods("ns", "j") == []
    cluster.remember_failed_pod(running, deleted=True)
    (kept,) = cluster.list_job_pods("ns", "j")
    assert kept["metadata"]["deletionTimestamp"]
