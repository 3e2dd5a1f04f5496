"""Progress to Kubeflow Trainer's status endpoint (trainjob_status.py): the report read back from
the payload as the operator does, and the reporter against a real HTTPS server (a CA of its own, a
bearer token file the kubelet rotates, a server that fails). The payload against the TrainJob CRD's
schema: tests/rendering/test_trainer_status_schema.py."""

from __future__ import annotations

import http.server
import json
import math
import ssl
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from e2e.lab.pki import make_ca, make_leaf
from finetune_trainer.contract import ProgressReport, progress_from_trainer_status, trainer_status_payload
from finetune_trainer.trainjob_status import CA_ENV, TOKEN_ENV, URL_ENV, Endpoint, StatusReporter, rfc3339


def report(**fields) -> ProgressReport:
    base = dict(time=1_800_000_000.25, attempt=2, step=30, maxSteps=120, startStep=20, elapsedSeconds=50.0,
                loss=1.375, tokensPerSecond=812.5, evalLoss=1.5, evalStep=24)
    base.update(fields)
    return ProgressReport(**base)


# ---------------------------------------------------------------- the payload


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=80, deadline=None)
@given(step=st.integers(0, 10**7), extra=st.integers(1, 10**7), loss=finite | st.just(float("nan")),
       tps=st.floats(0, 1e9, allow_nan=False), eval_loss=st.none() | finite, lr=st.none() | st.floats(1e-9, 1.0))
def test_the_report_reads_back_from_trainer_status_as_it_was_sent(step, extra, loss, tps, eval_loss, lr):
    sent = report(step=step, maxSteps=step + extra, startStep=0, loss=loss, tokensPerSecond=tps, evalLoss=eval_loss,
                  learningRate=lr)
    status = trainer_status_payload(sent, remaining_seconds=None, updated="2027-01-15T08:00:00Z")["trainerStatus"]
    assert 0 <= status["progressPercentage"] <= 100
    assert all(len(m["value"]) <= 64 and 1 <= len(m["name"]) <= 64 for m in status["metrics"])
    back = progress_from_trainer_status(status)
    assert back is not None
    if math.isnan(loss):
        assert math.isnan(back.loss)
        back, sent = back.model_copy(update={"loss": 0.0}), sent.model_copy(update={"loss": 0.0})
    assert back == sent


@pytest.mark.parametrize("status", [
    None, "garbage", {}, {"metrics": "x"},
    # What transformers' KubeflowTrainerCallback or another script writes: not our report.
    {"progressPercentage": 40, "metrics": [{"name": "loss", "value": "0.2"}, {"name": "epoch", "value": "1"}],
     "lastUpdatedTime": "2027-01-15T08:00:00Z"},
    # Ours but broken: a value that is not a number, a step past the end of its own range.
    {"metrics": [{"name": "time", "value": "1.0"}, {"name": "step", "value": "ten"}, {"name": "maxSteps", "value": "5"}]},
    {"metrics": [{"name": "time", "value": "1.0"}, {"name": "step", "value": "3"}, {"name": "maxSteps", "value": "5"},
                 {"name": "startStep", "value": "4"}]},
])
def test_a_trainer_status_not_of_this_trainer_reads_as_nothing(status):
    assert progress_from_trainer_status(status) is None


# ---------------------------------------------------------------- the reporter


class StatusServer:
    """An HTTPS endpoint like Trainer's: checks the bearer token, keeps what was posted."""

    def __init__(self, tmp: Path, token: str = "t-1", fail: bool = False) -> None:
        ca = make_ca(tmp, "ca", "status-ca")
        leaf = make_leaf(tmp, ca, "server", "localhost", dns_names=("localhost",), ip_addresses=("127.0.0.1",),
                         server=True)
        self.ca_file, self.token_file = str(ca.cert), tmp / "token"
        self.token_file.write_text(token)
        self.accepted_token, self.fail = token, fail
        self.bodies: list[dict] = []
        self.refused = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ok = self.headers.get("Authorization") == f"Bearer {outer.accepted_token}" and not outer.fail
                if ok:
                    outer.bodies.append(body)
                else:
                    outer.refused += 1
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(leaf.cert), str(leaf.key))
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/" \
                   "namespaces/team-a/trainjobs/support-bot-a2/status"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        return {URL_ENV: self.url, CA_ENV: self.ca_file, TOKEN_ENV: str(self.token_file)}

    def stop(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def server(tmp_path):
    s = StatusServer(tmp_path)
    yield s
    s.stop()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_no_endpoint_without_all_three_variables_or_over_plain_http(server):
    env = server.env()
    assert Endpoint.from_env(env) == Endpoint(server.url, server.ca_file, str(server.token_file))
    for missing in env:
        assert StatusReporter.from_env({k: v for k, v in env.items() if k != missing}) is None
    assert Endpoint.from_env({**env, URL_ENV: server.url.replace("https://", "http://")}) is None


def test_reports_go_to_the_endpoint_throttled_newest_first_and_close_sends_the_last(server):
    reporter = StatusReporter(Endpoint.from_env(server.env()), min_interval=0.5)
    reporter.submit(report(step=21), started=report().time - 10)
    wait_for(lambda: len(server.bodies) == 1)  # the first goes at once
    for step in (22, 23, 24):  # within the interval: only the newest of these is sent
        reporter.submit(report(step=step), started=report().time - 10)
    wait_for(lambda: len(server.bodies) == 2)
    time.sleep(0.7)
    assert len(server.bodies) == 2
    reporter.submit(report(step=25), started=report().time - 10)
    reporter.close()  # does not wait out the interval
    steps = [progress_from_trainer_status(b["trainerStatus"]).step for b in server.bodies]
    assert steps == [21, 24, 25]
    first = server.bodies[0]["trainerStatus"]
    # One step done in 10 s of this attempt, 99 to go.
    assert first["estimatedRemainingSeconds"] == 990 and first["progressPercentage"] == 17


def test_the_token_is_read_anew_for_each_request(server):
    reporter = StatusReporter(Endpoint.from_env(server.env()), min_interval=0.0)
    reporter.submit(report(step=21), started=0)
    wait_for(lambda: len(server.bodies) == 1)
    server.token_file.write_text("t-2\n")  # the kubelet rotated the projected token
    server.accepted_token = "t-2"
    reporter.submit(report(step=22), started=0)
    wait_for(lambda: len(server.bodies) == 2)
    reporter.close()
    assert server.refused == 0


def test_a_failing_or_absent_endpoint_never_raises_into_training(tmp_path, caplog):
    failing = StatusServer(tmp_path, fail=True)
    reporter = StatusReporter(Endpoint.from_env(failing.env()), min_interval=0.0)
    for step in (21, 22):
        reporter.submit(report(step=step), started=0)
        time.sleep(0.2)
    reporter.close()
    assert failing.refused >= 1 and failing.bodies == [] and reporter.sent == 0
    failing.stop()
    # Nothing listens there any more, and a CA that did not sign the server: logged, not raised.
    gone = StatusReporter(Endpoint.from_env(failing.env()), min_interval=0.0)
    gone.submit(report(step=23), started=0)
    gone.close()
    assert gone.sent == 0
    assert any("progress not sent" in r.getMessage() for r in caplog.records)
