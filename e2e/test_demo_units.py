"""`make demo` without a lab (not e2e): the progress display ends with the final row, and the
command it suggests for a kept lab is one `python -m e2e.lab` accepts."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

from e2e import demo
from e2e.lab.__main__ import main as lab_main

HEADER = "NAME          PHASE       REASON   MODEL   AGE"


class _RacingLab:
    """kubectl answers in the order the demo asks: the table still shows Running when the JSON
    read already sees Succeeded (the job ended between the two reads)."""

    def __init__(self) -> None:
        self.tables = iter([f"{HEADER}\nsupport-bot   Running              m       5s",
                            f"{HEADER}\nsupport-bot   Succeeded            m       6s"])

    def kubectl(self, *args: str, check: bool = True) -> SimpleNamespace:
        if "-o" in args:
            return SimpleNamespace(stdout=json.dumps({"status": {"phase": "Succeeded"}}))
        return SimpleNamespace(stdout=next(self.tables))


def test_watch_prints_the_final_row(capsys):
    demo.watch(_RacingLab(), "team-a", "support-bot", timeout=5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == HEADER
    assert lines[-1].split()[:2] == ["support-bot", "Succeeded"], lines


def test_the_suggested_down_command_is_accepted(tmp_path, capsys):
    workdir = tmp_path / "a lab"
    argv = shlex.split(demo.down_command(workdir))
    assert argv[:4] == ["python", "-m", "e2e.lab", "down"]
    assert lab_main(argv[3:]) == 0  # no lab there: "no lab in ...", not a usage error
    assert f"no lab in {workdir}" in capsys.readouterr().out


def test_the_demo_builds_only_what_it_starts(monkeypatch):
    """The demo starts neither the S3 server nor JobSet, Trainer v2 or Kueue: it builds the lab's
    Kubernetes binaries and no optional component (on a fresh machine those were 513 of 1593 s);
    on the real node (the default), also the node's binaries and the two images."""
    import e2e.lab.build as lab_build
    import e2e.lab.cluster as lab_cluster
    import e2e.lab.images as lab_images

    built: list[str] = []
    monkeypatch.setattr(lab_build, "_build_kubernetes_lab", lambda force, say: built.append("kubernetes"))
    monkeypatch.setattr(lab_build, "build_s3_server", lambda **kw: built.append("s3"))
    monkeypatch.setattr(lab_build, "build_v2", lambda **kw: built.append("v2"))
    monkeypatch.setattr(lab_build, "build_node", lambda **kw: built.append("node"))
    monkeypatch.setattr(lab_images, "build_all", lambda **kw: built.append("images"))
    monkeypatch.setattr(demo.os, "geteuid", lambda: 0)

    class _Stop(Exception):
        pass

    started: list[tuple] = []

    def no_lab(**kwargs):
        started.append(tuple(kwargs.get("components") or ()))
        raise _Stop

    monkeypatch.setattr(lab_cluster, "up", no_lab)
    for argv in ([], ["--fake-gpu"]):
        try:
            demo.main(argv)
        except _Stop:
            pass
    assert built == ["kubernetes", "node", "images", "kubernetes"]
    assert started == [("kubelet",), ()]  # the real nodes, then the fake-GPU lab
    lab_build.build(say=lambda msg: None)  # what `make test` builds: everything
    assert built[-3:] == ["kubernetes", "s3", "v2"]


def test_without_root_the_demo_says_how_to_run_it(monkeypatch, capsys):
    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    assert demo.main([]) == 2
    assert "--fake-gpu" in capsys.readouterr().out
