"""The rendered pods, run as real processes: each workload's own container command
on the ConfigMap's cluster YAML, each in a mount namespace whose /etc/hosts maps
the pods' DNS names to their own loopback address (127.0.1.x), as a pod's
/etc/hosts and the cluster DNS do on Kubernetes. So the servers bind and
advertise the DNS names the render gave them, the prefill server reaches the
decode server by name, and the secrets come from files as from the mounted
Secret. Only two things differ from a pod: the Secret's folder, and the router
binding 127.0.0.1 instead of 0.0.0.0 (tests bind loopback only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from deploy.k8s import SECRET_DIR
from tests.deploy.manifests import REPO, container, render
from tests.support.cluster import make_config
from tests.support.oracle import PROMPTS, expected_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

INTERNAL = "pods-internal-secret-5be0c1d2"
KEY = "sk-pods-client-3a9f"
# mount --bind a hosts file over /etc/hosts in a private mount namespace, then run the command
IN_PODS_HOSTS = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"']


class Pod:
    def __init__(self, name: str, command: list[str], hosts: Path, log: Path) -> None:
        self.name = name
        self.log = log
        # `pdserve ARGS` as the manifest says, from this checkout
        argv = [*IN_PODS_HOSTS, str(hosts), sys.executable, "-m", "deploy.cli", *command[1:]]
        self.popen = subprocess.Popen(
            argv, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO))
        )

    def stop(self) -> int:
        """SIGTERM (what the kubelet sends after preStop), SIGKILL if it outlives the wait."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()


@pytest.fixture(scope="module")
def pods(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("pods")
    config = make_config(
        tmp, "tiny-1p1d", tiny_model, {"security": {"internal_secret": INTERNAL}, "router": {"api_keys": [KEY]}}
    )
    m = render(config, tmp / "manifests", "--name", "pods")
    (cm,) = m.of_kind("ConfigMap")
    mounted = tmp / "secrets"
    mounted.mkdir()
    (mounted / "internal-secret").write_text(INTERNAL + "\n")
    (mounted / "api-keys").write_text(KEY + "\n")
    pod_config = yaml.safe_load(cm["data"]["cluster.yaml"].replace(SECRET_DIR, str(mounted)))
    pod_config["router"]["host"] = "127.0.0.1"
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(pod_config))
    addresses, lines = {}, []
    for i, inst in enumerate(pod_config["prefill"] + pod_config["decode"]):
        addresses[inst["name"]] = f"127.0.1.{i + 1}"
        lines.append(f"{addresses[inst['name']]} {inst['host']}")
    for entry in pod_config["discovery"]["names"]:  # what the headless Services resolve to
        name = entry.rpartition(":")[0]
        role = "prefill" if "-prefill-" in name else "decode"
        lines += [f"{addresses[i['name']]} {name}" for i in pod_config[role]]
    hosts = tmp / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + "\n".join(lines) + "\n")
    started: list[Pod] = []
    try:
        for w in m.workloads():
            command = container(w)["command"]
            command = [str(tmp / "cluster.yaml") if part == command[3] else part for part in command]
            started.append(Pod(w["metadata"]["name"], command, hosts, tmp / f"{w['metadata']['name']}.log"))
        urls = {
            i["name"]: f"http://{addresses[i['name']]}:{i['port']}"
            for i in pod_config["prefill"] + pod_config["decode"]
        }
        router = f"http://127.0.0.1:{pod_config['router']['port']}"
        with httpx.Client(timeout=5) as http:

            def healthy() -> bool:
                for pod in started:
                    assert pod.popen.poll() is None, f"{pod.name} exited:\n{pod.log.read_text()}"
                try:
                    return all(http.get(f"{u}/health").status_code == 200 for u in [*urls.values(), router])
                except httpx.TransportError:
                    return False

            wait_until(healthy, 180, "every pod answers /health")
        yield {"pods": started, "urls": urls, "router": router, "config": pod_config}
    finally:
        for pod in started:
            pod.stop()


def test_servers_answer_at_the_dns_names_the_render_gave_them_and_bind_every_interface(pods):
    with httpx.Client(timeout=5) as http:
        for name, url in pods["urls"].items():
            assert http.get(f"{url}/health").json()["instance"] == name  # answered at its pod's address
        # bind_host 0.0.0.0: the pod's other addresses (kubectl port-forward's loopback) answer too
        assert http.get(pods["urls"]["d0"].replace("127.0.1.", "127.0.0.") + "/health").json()["instance"] == "d0"


def test_greedy_answers_through_the_rendered_pods_equal_transformers(pods, tiny_model):
    client = openai.OpenAI(base_url=f"{pods['router']}/v1", api_key=KEY, max_retries=0)
    for prompt in PROMPTS:
        text, count = expected_completion(tiny_model, prompt, 16)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert (r.choices[0].text, r.usage.completion_tokens) == (text, count)
    stranger = openai.OpenAI(base_url=f"{pods['router']}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the keys came from the mounted file
        stranger.completions.create(model="tiny", prompt="hi", max_tokens=2)
    with httpx.Client(timeout=5) as http:
        # internal routes want the secret from the mounted file
        assert http.post(f"{pods['urls']['d0']}/abort", json={"request_id": "x"}).status_code == 401
        ok = http.post(
            f"{pods['urls']['d0']}/abort", json={"request_id": "x"}, headers={"Authorization": f"Bearer {INTERNAL}"}
        )
        assert ok.status_code == 200

        def idle() -> bool:
            blocks = [http.get(f"{u}/health").json()["kv_blocks"] for u in pods["urls"].values()]
            return all(b["reserved"] == 0 and b["running"] == 0 for b in blocks)

        wait_until(idle, 5, "every server back to zero reserved and running blocks")


def test_sigterm_drains_and_exits_well_inside_the_grace_period(pods):
    grace = 10 + 30 + 10  # preStop + drain_timeout_s + margin, as rendered (tests/deploy/test_k8s_wiring.py)
    for pod in reversed(pods["pods"]):  # the router first, then the servers
        start = time.monotonic()
        code = pod.stop()
        took = time.monotonic() - start
        # uvicorn re-raises the SIGTERM once it has shut down cleanly: -15, not a crash
        assert code == -signal.SIGTERM, pod.log.read_text()
        assert "drained; shutting down" in pod.log.read_text()
        assert took < grace - 10
