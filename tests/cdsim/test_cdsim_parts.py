"""The pieces of cdsim that need no running cluster: flags handed to the services, claims built
for the node agent, the job file, the timeline, the progress bar and the fork server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from libs.contract.channel_config import parse_parameters_json
from libs.gen.computedomain.state import v1 as pb
from libs.runtime.settings import load_settings
from services.advisor.settings import AdvisorSettings
from services.controller.settings import ControllerSettings
from services.imexagent.settings import ImexAgentSettings
from services.nodeagent.settings import AgentSettings
from tests.polling import wait_until
from tools.cdsim import credentials, jobs
from tools.cdsim.job_book import ClaimRecord, Job, JobBook
from tools.cdsim.layout import MAX_UNIX_SOCKET_PATH, StateLayout
from tools.cdsim.lifecycle import CommandError, UpOptions, up
from tools.cdsim.progress import Progress, render_bar
from tools.cdsim.run_state import SimConfig
from tools.cdsim.services import Ports, advisor_spec, agent_spec, all_specs, controller_spec, imex_agent_spec
from tools.cdsim.status import tray_cell
from tools.cdsim.timeline import SubmitTimeline
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=2, trays_per_rack=3, address_block=77)


def test_agent_flags_are_understood_by_the_node_agent(tmp_path: Path) -> None:
    layout = StateLayout.at(tmp_path)
    spec = agent_spec(CLUSTER, "rack1-tray2", layout, SimConfig(), "127.0.0.1:2379")
    settings = load_settings(AgentSettings, spec.argv, env={})
    assert settings.node_name == "rack1-tray2"
    assert settings.hardware == "simulated"
    assert settings.claim_source == "store"
    assert Path(settings.kubelet_dir) == layout.node("rack1-tray2").kubelet_dir
    assert Path(settings.cdi_root) == layout.node("rack1-tray2").cdi_root
    # Health is served on the node's own loopback address: no port to hand out per agent.
    assert spec.health_url == f"http://127.77.1.3:{settings.health_port}/healthz"


def test_imex_agent_flags_are_understood_by_the_imex_agent(tmp_path: Path) -> None:
    layout = StateLayout.at(tmp_path)
    spec = imex_agent_spec(CLUSTER, "rack1-tray2", layout, SimConfig(), "127.0.0.1:2379")
    settings = load_settings(ImexAgentSettings, spec.argv, env={})
    assert (settings.node_name, settings.node_ip) == ("rack1-tray2", "127.77.1.3")
    assert settings.hardware == "simulated"
    assert Path(settings.imex_work_dir) == layout.node("rack1-tray2").imex_dir
    # The node record names the plugin's directories.
    assert Path(settings.kubelet_dir) == layout.node("rack1-tray2").kubelet_dir
    assert spec.health_url == f"http://127.77.1.3:{settings.health_port}/healthz"


def test_controller_flags_are_understood_by_the_controller() -> None:
    spec = controller_spec(1, 4567, SimConfig(), "127.0.0.1:2379")
    settings = load_settings(ControllerSettings, spec.argv, env={})
    assert settings.identity == "controller-1"
    assert settings.health_port == 4567
    assert settings.mode == "simulation"


def test_advisor_flags_are_understood_by_the_advisor() -> None:
    spec = advisor_spec(4000, 4001, SimConfig(), "127.0.0.1:2379")
    settings = load_settings(AdvisorSettings, spec.argv, env={})
    assert (settings.grpc_host, settings.grpc_port, settings.health_port) == ("127.0.0.1", 4000, 4001)
    assert settings.extender_enabled is False


def test_one_agent_per_node_and_two_controllers(tmp_path: Path) -> None:
    specs = all_specs(CLUSTER, StateLayout.at(tmp_path), SimConfig(), Ports(1, 2, 3, (4, 5)))
    kinds = [s.kind for s in specs]
    assert kinds.count("agent") == CLUSTER.node_count
    assert kinds.count("controller") == 2
    assert kinds.count("advisor") == 1
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.health_url for s in specs}) == len(specs)


SETTINGS_OF_KIND = {
    "agent": AgentSettings,
    "imex-agent": ImexAgentSettings,
    "controller": ControllerSettings,
    "advisor": AdvisorSettings,
}


@pytest.mark.parametrize("kubernetes", [False, True], ids=["simulation", "kubernetes"])
def test_a_secured_run_gives_each_service_its_own_etcd_certificate(tmp_path: Path, kubernetes: bool) -> None:
    layout = StateLayout.at(tmp_path)
    config = SimConfig(secure=True, kubernetes=kubernetes)
    pki = layout.pki_dir
    for spec in all_specs(CLUSTER, layout, config, Ports(1, 2, 3, (4, 5))):
        settings = load_settings(SETTINGS_OF_KIND[spec.kind], spec.argv, env={})
        etcd = settings.etcd_config()
        identity = credentials.IDENTITY_OF_KIND[spec.kind]
        assert (etcd.ca_file, etcd.cert_file, etcd.key_file) == (
            str(pki / "ca.crt"),
            str(pki / f"{identity}.crt"),
            str(pki / f"{identity}.key"),
        ), spec.name
        assert (etcd.username, etcd.password) == (None, None), "etcd takes the user from the certificate"
        if isinstance(settings, AdvisorSettings):
            # kube-scheduler calls the extender without a client certificate.
            mtls = (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            assert mtls == (
                ("", "", "")
                if kubernetes
                else (str(pki / "advisor-server.crt"), str(pki / "advisor-server.key"), str(pki / "ca.crt"))
            )


def test_a_plaintext_run_passes_no_certificate(tmp_path: Path) -> None:
    for spec in all_specs(CLUSTER, StateLayout.at(tmp_path), SimConfig(secure=False), Ports(1, 2, 3, (4, 5))):
        assert not any(flag.startswith(("--etcd-ca", "--etcd-cert", "--tls-")) for flag in spec.argv), (
            spec.name
        )


def test_claim_carries_exactly_what_the_node_agent_decodes() -> None:
    record = ClaimRecord(uid="c-1", name="job-worker-0-channel", namespace="team-a", node="rack0-tray1")
    claim = jobs.build_claim(record, "d-uid", "All", 1000)
    assert [(r.request, r.driver, r.pool, r.device) for r in claim.results] == [
        ("channel", "compute-domain.nvidia.com", "rack0-tray1", "channel-0")
    ]
    assert json.loads(claim.config[0].parameters_json) == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": "d-uid",
        "allocationMode": "All",
    }
    decoded = parse_parameters_json(claim.config[0].parameters_json)
    assert decoded is not None


def test_domain_record_of_a_job() -> None:
    job = Job("train", "ns", "uid-1", 4, "Single", "submitting", 0)
    domain = jobs.build_domain(job, 42)
    assert (domain.uid, domain.namespace, domain.name, domain.spec.num_nodes) == ("uid-1", "ns", "train", 4)
    assert domain.spec.channel.allocation_mode == pb.AllocationMode.SINGLE
    assert domain.status.status == pb.Readiness.NOT_READY
    assert domain.source == "simulation"


def test_claims_are_planned_one_per_node_with_unique_uids() -> None:
    claims = jobs.plan_claims("job", "default", ["a", "b", "c"])
    assert [c.node for c in claims] == ["a", "b", "c"]
    assert len({c.uid for c in claims}) == 3
    assert [c.name for c in claims] == [
        "job-worker-0-channel",
        "job-worker-1-channel",
        "job-worker-2-channel",
    ]


def test_job_book_round_trip_and_concurrent_updates(tmp_path: Path) -> None:
    book = JobBook(tmp_path / "jobs.json")
    claim = ClaimRecord("u", "n", "ns", "rack0-tray0")

    def add(i: int) -> None:
        job = Job(f"job-{i}", "ns", f"uid-{i}", 1, "Single", "running", i, (claim,))
        book.update(lambda jobs_: jobs_.put(job))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs_ = book.read()
    assert sorted(j.name for j in jobs_.jobs) == sorted(f"job-{i}" for i in range(16))
    assert jobs_.find("ns", "job-3") is not None
    found = jobs_.find("ns", "job-3")
    assert found is not None and found.claims == (claim,)
    book.update(lambda j: j.remove("ns", "job-3"))
    assert book.read().find("ns", "job-3") is None


def test_job_book_rejects_a_file_of_another_version(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"version": 99, "jobs": []}))
    with pytest.raises(ValueError, match="version"):
        JobBook(path).read()


def test_timeline_lists_milestones_in_ms_after_submit() -> None:
    t = SubmitTimeline(started_ms=10_000)
    t.placed_ms, t.placement_note = 10_004, "2 nodes"
    t.created_ms, t.created_note = 10_010, "domain"
    t.joined = {"n1": (10_050, 0), "n2": (10_280, 1)}
    t.daemon_ready = {"n1": 10_200, "n2": 10_300}
    t.prepared = {"n1": (10_310, 1), "n2": (10_320, 3)}
    t.domain_ready_ms = 10_400
    text = "\n".join(t.lines(2))
    assert "4 ms  placed: 2 nodes" in text
    assert "50 ms  first node joined the domain: n1 (index 0)" in text
    assert "280 ms  2/2 nodes joined" in text
    assert "300 ms  2/2 IMEX daemons READY" in text
    assert "320 ms  2/2 channel claims prepared (1 needed kubelet retries)" in text
    assert text.splitlines()[-1].strip() == "400 ms  ComputeDomain status: Ready"
    offsets = [int(line.split()[0]) for line in text.splitlines()]
    assert offsets == sorted(offsets)


def test_progress_bar_without_a_terminal_prints_whole_lines(tmp_path: Path) -> None:
    assert render_bar(5, 10, "done", width=10) == "[#####.....] 5/10 done"
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        progress = Progress(3, "claims prepared", out)
        for _ in range(3):
            progress.advance()
    lines = out_path.read_text().splitlines()
    assert lines[-1].startswith("[" + "#" * 30 + "] 3/3 claims prepared")
    assert "\r" not in out_path.read_text()


def test_up_refuses_a_state_dir_too_long_for_unix_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (MAX_UNIX_SOCKET_PATH - 20))
    with pytest.raises(CommandError, match="too long"):
        up(StateLayout.at(deep), UpOptions(racks=1, trays=2), sys.stdout)
    assert not deep.exists()


def test_up_refuses_a_bad_cluster_shape(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="racks must be >= 1"):
        up(StateLayout.at(tmp_path / "s"), UpOptions(racks=0), sys.stdout)


REPO_ROOT = Path(__file__).resolve().parents[2]


def _zygote(tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tools.cdsim.zygote", "--preload", "json", "--state-dir", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(tmp_path),
        env=env,
    )


def _read_message(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "fork server closed its output"
    return dict(json.loads(line))


def test_fork_server_runs_a_target_as_its_own_process_and_reports_its_exit(tmp_path: Path) -> None:
    proc = _zygote(tmp_path)
    assert proc.stdin is not None
    try:
        log = tmp_path / "child.log"
        request = {
            "id": 7,
            "op": "spawn",
            "name": "probe",
            "target": "tests.cdsim.zygote_targets:echo_and_exit",
            "argv": ["--code", "3"],
            "log": str(log),
            "env": {"PROBE_VALUE": "hello"},
        }
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        answer = _read_message(proc)
        assert answer["id"] == 7
        pid = answer["pid"]
        assert isinstance(pid, int) and pid != proc.pid
        event = _read_message(proc)
        assert event == {"event": "exit", "pid": pid, "code": 3, "signal": 0}
        assert log.read_text().splitlines() == ["argv=['probe', '--code', '3'] env=hello"]
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_fork_server_reports_a_kill_and_terminates_children_when_its_input_closes(tmp_path: Path) -> None:
    proc = _zygote(tmp_path)
    assert proc.stdin is not None
    pids = []
    for i in range(2):
        proc.stdin.write(
            json.dumps(
                {
                    "id": i,
                    "op": "spawn",
                    "name": f"sleeper{i}",
                    "target": "tests.cdsim.zygote_targets:sleep_forever",
                    "log": str(tmp_path / f"s{i}.log"),
                }
            )
            + "\n"
        )
        proc.stdin.flush()
        pids.append(int(_read_message(proc)["pid"]))  # type: ignore[call-overload]
    os.kill(pids[0], 9)
    assert _read_message(proc) == {"event": "exit", "pid": pids[0], "code": None, "signal": 9}
    proc.stdin.close()
    proc.wait(15)
    wait_until(lambda: not Path(f"/proc/{pids[1]}").exists(), "the fork server's other child to end", 5)


def test_fork_server_answers_a_bad_request_with_an_error(tmp_path: Path) -> None:
    proc = _zygote(tmp_path)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps({"id": 1, "op": "spawn", "name": "x"}) + "\n")
        proc.stdin.flush()
        answer = _read_message(proc)
        assert answer["id"] == 1 and "target" in str(answer["error"])
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_tray_without_a_node_record_is_not_drawn_free() -> None:
    def node(**over: object) -> dict[str, object]:
        return {"agent_running": True, "registered": True, "domain": ""} | over

    letters = {"uid-a": "A"}
    cells = [
        tray_cell(node(), letters),
        tray_cell(node(registered=False), letters),
        tray_cell(node(agent_running=False, registered=False), letters),
        tray_cell(node(domain="uid-a"), letters),
        tray_cell(node(domain="uid-gone"), letters),
    ]
    assert cells == [".", "-", "!", "A", "?"]
