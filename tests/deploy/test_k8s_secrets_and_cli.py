"""Secrets stay out of the rendered files, the command line behaves, and the
image's Dockerfile installs with scripts/install.sh."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from deploy.cli import main
from deploy.config import ConfigError, parse_config
from deploy.k8s import MODEL_CACHE, RUN_AS, SECRET_DIR
from tests.deploy.manifests import CONFIGS, REPO, Manifests, container, render

INTERNAL = "internal-secret-value-4f1c9a7b"
KEYS = ["sk-client-one-90d2e1", "sk-client-two-77ab03"]


def _config_with_secrets(tmp_path):
    config = tmp_path / "secret-demo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": "tiny",
                "security": {"internal_secret": INTERNAL},
                "router": {"port": 8000, "api_keys": KEYS},
                "prefill": [{"name": "p0", "port": 8100}],
                "decode": [{"name": "d0", "port": 8200}],
            }
        )
    )
    return config


def test_no_secret_value_reaches_the_manifests_or_the_output(tmp_path, capsys):
    m = render(_config_with_secrets(tmp_path), tmp_path / "out")
    printed = capsys.readouterr().out
    for value in [INTERNAL, *KEYS]:
        assert value not in m.text()
        assert value not in printed
    assert "Secret" not in {o["kind"] for o in m.objects}
    cluster = m.pod_config()
    assert cluster.security.internal_secret_file == f"{SECRET_DIR}/internal-secret"
    assert (cluster.security.internal_secret, cluster.router.api_keys) == (None, [])
    assert cluster.router.api_keys_file == f"{SECRET_DIR}/api-keys"
    for w in m.workloads():
        (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "secrets"]
        assert vol["secret"]["secretName"] == "pdserve-secret-demo-secrets"
        assert [i["key"] for i in vol["secret"]["items"]] == ["internal-secret", "api-keys"]
        assert {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True} in container(w)["volumeMounts"]
    assert (
        "kubectl -n default create secret generic pdserve-secret-demo-secrets "
        "--from-file=internal-secret=./internal-secret --from-file=api-keys=./api-keys"
    ) in printed


def test_a_config_without_api_keys_mounts_only_the_internal_secret(tmp_path):
    m = render(CONFIGS[0], tmp_path)
    cluster = m.pod_config()
    assert cluster.router.api_keys_file is None
    assert cluster.model_cache == MODEL_CACHE
    for w in m.workloads():
        (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "secrets"]
        assert [i["key"] for i in vol["secret"]["items"]] == ["internal-secret"]


def test_api_keys_are_read_from_a_file_one_per_line(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEYS[0]}\n\n  {KEYS[1]}  \n")
    base = {"model": "tiny", "prefill": [{"name": "p0", "port": 8100}], "decode": [{"name": "d0", "port": 8200}]}
    cluster = parse_config({**base, "router": {"api_keys_file": str(keys)}}, "t.yaml")
    assert cluster.router.api_key_values() == tuple(KEYS)
    with pytest.raises(ConfigError, match="router.api_keys or router.api_keys_file, not both"):
        parse_config({**base, "router": {"api_keys_file": str(keys), "api_keys": KEYS}}, "t.yaml")
    missing = parse_config({**base, "router": {"api_keys_file": str(tmp_path / "none")}}, "t.yaml")
    with pytest.raises(ConfigError, match="cannot read it"):
        missing.router.api_key_values()


def test_discovery_is_static_unless_dns_names_are_given(tmp_path):
    base = {"model": "tiny", "prefill": [{"name": "p0", "port": 8100}], "decode": [{"name": "d0", "port": 8200}]}
    assert parse_config(base, "t.yaml").discovery.kind == "static"
    with pytest.raises(ConfigError, match="discovery.kind dns needs discovery.names"):
        parse_config({**base, "discovery": {"kind": "dns"}}, "t.yaml")
    with pytest.raises(ConfigError, match="unknown key 'discovery.name'"):
        parse_config({**base, "discovery": {"kind": "dns", "name": "x"}}, "t.yaml")


def test_render_help_names_the_command_and_its_options():
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "render", "k8s", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pdserve render k8s")
    for option in ("--out", "--name", "--namespace", "--image"):
        assert option in out.stdout


def test_rendering_again_replaces_the_previous_render_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.yaml").write_text("mine: true\n")
    two = REPO / "configs" / "2p1d.yaml"
    one = REPO / "configs" / "1p1d.yaml"
    assert main(["render", "k8s", str(two), "--out", str(out), "--name", "demo", "--image", "r.io/pdserve:1"]) == 0
    assert main(["render", "k8s", str(one), "--out", str(out), "--name", "demo", "--image", "r.io/pdserve:1"]) == 0
    fresh = render(one, tmp_path / "fresh", "--name", "demo", "--image", "r.io/pdserve:1")
    kept = sorted(f.name for f in out.glob("*.yaml"))
    assert kept == sorted([f.name for f in fresh.files] + ["notes.yaml"])
    (out / "notes.yaml").unlink()
    assert Manifests(out).objects == fresh.objects
    assert {container(w)["image"] for w in fresh.workloads()} == {"r.io/pdserve:1"}


def test_instance_names_that_kubernetes_cannot_tell_apart_are_refused(tmp_path, capsys):
    config = tmp_path / "clash.yaml"
    config.write_text(
        "model: tiny\nprefill: [{name: p_0, port: 8100}, {name: P.0, port: 8110}]\ndecode: [{name: d0, port: 8200}]\n"
    )
    assert main(["render", "k8s", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "['pdserve-clash-p-0']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_dockerfile_installs_with_the_script_and_exposes_the_default_ports():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^RUN bash scripts/install\.sh$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert "TORCH_INDEX_URL" in (REPO / "scripts" / "install.sh").read_text()  # the script honours the build arg
    assert MODEL_CACHE in text  # prebuilt models where the rendered config looks for them
    assert re.search(rf"^USER {RUN_AS}$", text, re.M)  # the user the rendered pods run as
    (expose,) = re.findall(r"^EXPOSE (.+)$", text, re.M)
    default = parse_config(yaml.safe_load((REPO / "configs" / "1p1d.yaml").read_text()), "1p1d.yaml")
    ports = {default.router.port} | {p for i in default.instances() for p in (i.port, i.transfer_port)}
    assert {int(p) for p in expose.split()} == ports


def test_a_pod_gets_its_settings_from_the_rendered_config_and_the_mounted_secret(tmp_path, tiny_model):
    """What `pdserve decode|router --config /etc/pdserve/config/cluster.yaml` does in a pod, with the
    Secret's files at a temporary path instead of /etc/pdserve/secrets."""
    m = render(_config_with_secrets(tmp_path), tmp_path / "out")
    (cm,) = m.of_kind("ConfigMap")
    text = cm["data"]["cluster.yaml"].replace(SECRET_DIR, str(tmp_path / "mounted"))
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / "internal-secret").write_text(INTERNAL + "\n")
    (tmp_path / "mounted" / "api-keys").write_text("\n".join(KEYS) + "\n")
    cluster = parse_config(yaml.safe_load(text), "ConfigMap")
    d0 = cluster.server_settings("d0", tiny_model)
    fqdn = "pdserve-secret-demo-d0-0.pdserve-secret-demo-decode-headless.default.svc.cluster.local"
    assert (d0.host, d0.port, d0.kv_port, d0.internal_secret) == (fqdn, 8200, 8201, INTERNAL)
    assert d0.url == f"http://{fqdn}:8200"  # what its reservations advertise
    router = cluster.router_settings(tiny_model)
    assert (router.host, router.api_keys, router.internal_secret) == ("0.0.0.0", tuple(KEYS), INTERNAL)
    # No fixed worker list: the router finds them by re-resolving the headless Services (router/cluster/discovery.py).
    assert router.workers == () and router.discovery.kind == "dns"
    assert router.discovery.names == (
        "pdserve-secret-demo-prefill-headless:8100",
        "pdserve-secret-demo-decode-headless:8200",
    )
    assert d0.bind_host == "0.0.0.0" and d0.listen_host == "0.0.0.0"


def test_a_bad_name_on_the_command_line_is_one_clear_line(tmp_path, capsys):
    assert main(["render", "k8s", str(CONFIGS[0]), "--out", str(tmp_path / "out"), "--name", "Bad_Name"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve render: error: --name 'Bad_Name': String should match pattern")
    assert len(err.strip().splitlines()) == 1
