"""The container image and the Kubernetes manifests, checked offline.

Each manifest of deploy/kubernetes is validated against the Kubernetes schemas that
kubernetes-validate ships, and the values that must agree with the node are read by the node's
own parser: every AIOPARAMSYNC_* variable is one of its flags and parses as that flag does, and
the grace period, the disruption budget, the probes and the Service follow from what it parsed.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from build_helpers import dockerfile

from aioparamsync.cli import node as node_cli

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
# The Kubernetes release the manifests are validated against (a schema kubernetes-validate ships).
KUBERNETES = "1.30"
# What the downward API gives a node's pod, for reading its variables as the kubelet would.
POD_FIELDS = {
    "metadata.name": "ps-0",
    "metadata.namespace": "training",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}
# The variables ParameterClient.from_env() reads.
CLIENT_VARIABLES = {
    "AIOPARAMSYNC_ADDRESSES",
    "AIOPARAMSYNC_PEERS_DNS",
    "AIOPARAMSYNC_TLS",
    "AIOPARAMSYNC_TLS_CA",
    "AIOPARAMSYNC_TLS_CERT",
    "AIOPARAMSYNC_TLS_KEY",
}
# The least time past the drain timeout a pod is given before it is killed (seconds).
GRACE_MARGIN = 10


def load_kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


RESOURCES = load_kustomization()["resources"]


def load_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def all_docs() -> list[dict]:
    return [doc for name in RESOURCES for doc in load_docs(name)]


def the(kind: str) -> dict:
    found = [d for d in all_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} among {RESOURCES}, found {len(found)}"
    return found[0]


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def known_variables() -> set[str]:
    """The variable of each of aioparamsync-node's flags, as from_environment reads them."""
    parser = node_cli.build_parser()
    flags = set()
    for action in parser._actions:
        longs = [f for f in action.option_strings if f.startswith("--")]
        if longs and action.dest not in ("help", "version"):
            flags.add(longs[0])
    return {node_cli.env_name(f) for f in flags}


def resolve_env(entries: list[dict]) -> dict[str, str]:
    """A container's variables as the kubelet sets them: fieldRefs, then $(VAR) of earlier ones."""
    env: dict[str, str] = {}
    for entry in entries:
        name = entry["name"]
        if "valueFrom" in entry:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in POD_FIELDS, f"{name}: no sample value for the field {path}"
            env[name] = POD_FIELDS[path]
            continue

        def expand(match: re.Match[str], name: str = name) -> str:
            # (Kubernetes leaves a reference to a later or unknown variable as it is)
            assert match[1] in env, f"{name} uses $({match[1]}), which is not defined before it"
            return env[match[1]]

        env[name] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, str(entry.get("value", "")))
    return env


def dockerfile_env() -> dict[str, str]:
    env = {}
    for word, rest in dockerfile():
        if word != "ENV":
            continue
        tokens = shlex.split(rest)
        if "=" not in tokens[0]:  # (the old form: ENV KEY VALUE)
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for token in tokens:
            key, _, value = token.partition("=")
            env[key] = value
    return env


def node_args():
    """The StatefulSet's node configuration, read as aioparamsync-node reads its environment."""
    parser = node_cli.build_parser()
    environ = {**dockerfile_env(), **resolve_env(container(the("StatefulSet"))["env"])}
    try:
        return parser.parse_args(node_cli.from_environment(parser, [], environ))
    except SystemExit:  # (parser.error: the reason is in the captured stderr)
        pytest.fail("aioparamsync-node refuses the StatefulSet's environment (see stderr)")


def container_port(workload: dict, port: int | str) -> int:
    """A port of the workload's container, by number or by name."""
    if isinstance(port, int):
        return port
    for p in container(workload).get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    raise AssertionError(f"the container has no port named {port!r}")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# Manifests and schemas.


def test_every_resource_exists_and_parses():
    assert RESOURCES, "kustomization.yaml lists no resources"
    for name in RESOURCES:
        assert (DEPLOY / name).is_file(), f"kustomization.yaml lists {name}, which is missing"
        docs = load_docs(name)
        assert docs, f"{name} holds no manifest"
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], name
    kinds = sorted(d["kind"] for d in all_docs())
    assert kinds == ["Job", "PodDisruptionBudget", "Service", "StatefulSet"]


@pytest.mark.parametrize("name", RESOURCES)
def test_manifests_validate_against_the_kubernetes_schemas(name):
    for doc in load_docs(name):
        # The version it answers is the schema it used: the one asked for, not an older one.
        assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == KUBERNETES


def misspelled_field(doc):
    doc["spec"]["replica"] = doc["spec"].pop("replicas")


def replicas_in_words(doc):
    doc["spec"]["replicas"] = "three"


def unknown_container_field(doc):
    doc["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"


def probe_port_as_a_list(doc):
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [9100]


@pytest.mark.parametrize(
    "breakage",
    [misspelled_field, replicas_in_words, unknown_container_field, probe_port_as_a_list],
)
def test_validation_refuses_a_broken_statefulset(breakage):
    doc = copy.deepcopy(the("StatefulSet"))
    breakage(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_generated_config_map_exists_and_validates():
    generators = load_kustomization()["configMapGenerator"]
    for generator in generators:
        data = {}
        for entry in generator["files"]:
            key, _, path = entry.rpartition("=")  # (files: [KEY=PATH] or [PATH])
            assert (DEPLOY / path).is_file(), f"the configMapGenerator's {path} is missing"
            data[key or Path(path).name] = (DEPLOY / path).read_text()
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": data,
        }
        kubernetes_validate.validate(config_map, KUBERNETES, strict=True)


# The node's configuration.


def test_every_node_variable_is_a_flag():
    known = known_variables()
    env = container(the("StatefulSet"))["env"]
    unknown = {e["name"] for e in env if e["name"].startswith("AIOPARAMSYNC_")} - known
    assert not unknown, f"not flags of aioparamsync-node: {sorted(unknown)}"


def test_the_node_accepts_its_environment():
    args = node_args()
    # As main() refuses: a node on every interface must tell its peers another address.
    if node_cli.unspecified_host(args.host):
        assert args.advertise is not None
    assert args.data_dir is not None, "the node keeps its parameters on its volume"
    assert args.metrics_port is not None, "the probes need the metrics port"


def test_the_node_advertises_its_pod_dns_name_and_finds_peers_by_the_service():
    statefulset, service = the("StatefulSet"), the("Service")
    env = resolve_env(container(statefulset)["env"])
    args = node_args()
    domain = f"{service['metadata']['name']}.{POD_FIELDS['metadata.namespace']}.svc.cluster.local"
    assert env["POD_NAME"] == POD_FIELDS["metadata.name"]
    assert args.advertise == (f"{POD_FIELDS['metadata.name']}.{domain}", args.port)
    assert env["AIOPARAMSYNC_PEERS_DNS"] == f"{domain}:{args.port}"
    if hasattr(args, "peers_dns"):  # (read by the node's own parser once it has the flag)
        assert args.peers_dns == (domain, args.port)


def test_the_data_directory_is_the_pods_volume():
    statefulset = the("StatefulSet")
    args = node_args()
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container(statefulset)["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert mounts.get(args.data_dir.rstrip("/")) in claims


def test_the_grace_period_outlasts_the_drain():
    grace = the("StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= node_args().drain_timeout + GRACE_MARGIN


def test_the_disruption_budget_keeps_a_copy_of_every_key():
    statefulset, pdb = the("StatefulSet"), the("PodDisruptionBudget")
    replicas = statefulset["spec"]["replicas"]
    factor = node_args().replication_factor or replicas  # (None: 'all', every node)
    assert 1 < factor <= replicas
    assert pdb["spec"]["maxUnavailable"] == factor - 1
    assert pdb["spec"]["selector"] == statefulset["spec"]["selector"]


def test_the_probes_ask_the_metrics_port():
    statefulset = the("StatefulSet")
    node = container(statefulset)
    metrics = node_args().metrics_port
    paths = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        check = node[probe]["httpGet"]
        assert check["path"] == path, probe
        assert container_port(statefulset, check["port"]) == metrics, probe


def test_the_service_is_headless_and_selects_the_nodes():
    statefulset, service, job = the("StatefulSet"), the("Service"), the("Job")
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is True
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selects(statefulset["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(spec["selector"], pod_labels)
    # The workers are not behind it.
    assert not selects(spec["selector"], job["spec"]["template"]["metadata"]["labels"])
    args = node_args()
    ports = {p["name"]: p for p in spec["ports"]}
    for name, number in (("thrift", args.port), ("metrics", args.metrics_port)):
        assert ports[name]["port"] == number
        assert container_port(statefulset, ports[name].get("targetPort", number)) == number


def test_the_nodes_run_unprivileged_as_the_images_user():
    statefulset = the("StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    user = int(dict(dockerfile())["USER"].split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == user
    assert pod["securityContext"]["fsGroup"] == user
    context = container(statefulset)["securityContext"]
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = anti[0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selects(term["labelSelector"]["matchLabels"], pod_labels)


# The workers.


def test_the_workers_reach_the_service():
    job, service, statefulset = the("Job"), the("Service"), the("StatefulSet")
    worker = container(job)
    env = resolve_env(worker["env"])
    client = {n for n in env if n.startswith("AIOPARAMSYNC_")}
    assert client <= CLIENT_VARIABLES, f"not read by ParameterClient.from_env(): {client}"
    domain = f"{service['metadata']['name']}.{POD_FIELDS['metadata.namespace']}.svc.cluster.local"
    assert env["AIOPARAMSYNC_ADDRESSES"] == f"{domain}:{node_args().port}"
    assert worker["image"] == container(statefulset)["image"]


def test_the_job_gives_each_worker_its_rank():
    job = the("Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    worker = container(job)
    (rank,) = [e for e in worker["env"] if e["name"] == "RANK"]
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == index
    world = int(resolve_env(worker["env"])["WORLD_SIZE"])
    assert spec["completions"] == spec["parallelism"] == world


def test_the_job_runs_the_generated_script():
    job = the("Job")
    worker = container(job)
    assert worker["command"][0] == "python"
    script = Path(worker["command"][1])
    (generator,) = load_kustomization()["configMapGenerator"]
    volumes = {
        v["name"]: v["configMap"]["name"]
        for v in job["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    }
    mounts = {Path(m["mountPath"]): m["name"] for m in worker["volumeMounts"]}
    assert volumes[mounts[script.parent]] == generator["name"]
    assert script.name in [Path(f.rpartition("=")[2]).name for f in generator["files"]]


def test_the_worker_script_imports():
    spec = importlib.util.spec_from_file_location("deploy_worker", DEPLOY / "worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert asyncio.iscoroutinefunction(module.main)


# The image.


def test_the_image_runs_the_node_as_a_numeric_user():
    instructions = dockerfile()
    words = dict(instructions)  # (the last of each)
    assert words["FROM"].startswith("python:3.11-slim")
    user = words["USER"].split(":")
    assert all(part.isdigit() for part in user) and int(user[0]) != 0
    assert json.loads(words["ENTRYPOINT"]) == ["aioparamsync-node"]
    installs = [rest for word, rest in instructions if word == "RUN" and "pip install" in rest]
    assert any("[metrics,etcd]" in rest and "--no-cache-dir" in rest for rest in installs)
    # the wheel it installs is built with the compiled fast path, or the build fails
    builds = [rest for word, rest in instructions if word == "RUN" and "pip wheel" in rest]
    assert any("AIOPARAMSYNC_REQUIRE_EXT=1" in rest for rest in builds), builds
    assert next(rest for word, rest in instructions if word == "FROM").endswith("AS build")
    args = node_args()
    assert {str(args.port), str(args.metrics_port)} <= set(words["EXPOSE"].split())


def test_every_image_variable_is_a_flag():
    env = {n for n in dockerfile_env() if n.startswith("AIOPARAMSYNC_")}
    assert env, "the image sets no AIOPARAMSYNC_* default"
    unknown = env - known_variables()
    assert not unknown, f"not flags of aioparamsync-node: {sorted(unknown)}"
