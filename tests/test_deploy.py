"""The deployment artefacts, checked offline: the container image's Dockerfile (parsed: non-root,
``epdserve`` entrypoint, torch pinned as pyproject pins it from PyTorch's CPU index, the package
built from exactly the build context the Dockerfile copies, its embedded model included) and the
Kubernetes manifests (every overlay rendered by ``kubectl kustomize``, every object validated
against the Kubernetes JSON schemas by ``kubernetes-validate``, and the properties an operator
relies on: probes, requests, non-root, headless discovery Services, the NetworkPolicy, the HPA's
metric, no secret in git, every container's command line accepted by epdserve's own parser).

No image is built and no cluster is reached here: docs/deploy.md says what that leaves unchecked."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from epdserve.cli import build_parser, encoder_config, router_config, serve_config
from epdserve.security.credentials import ClusterCredential, CredentialError

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
# the oldest release still widely run, and the newest kubernetes-validate knows
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
WORKER_ROLES = {"encoder", "pd", "prefill", "decode"}
POD_IP = "10.1.2.3"  # what the downward API gives $(POD_IP) in the command-line test


# ---- the Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, ``\\`` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions((ROOT / "Dockerfile").read_text())


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"torch\s*==", d)]
    return pin.split("==")[1].strip()


def test_dockerfile_parser_reads_continuations_and_comments() -> None:
    text = 'FROM a AS b\n# note\nRUN x \\\n    # inside\n    y\nENTRYPOINT ["e"]\n'
    assert dockerfile_instructions(text) == [("FROM", "a AS b"), ("RUN", "x y"), ("ENTRYPOINT", '["e"]')]


def test_image_runs_as_a_non_root_user(dockerfile: list[tuple[str, str]]) -> None:
    stage = final_stage(dockerfile)
    users = [rest for word, rest in stage if word == "USER"]
    assert users, "the runtime stage sets no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root"), f"USER {users[-1]} is root"
    # the user exists in the image, with the uid the Kubernetes securityContexts name
    created = " ".join(rest for word, rest in stage if word == "RUN")
    assert re.search(rf"useradd\b.*--uid {user}\b", created), f"no useradd creates uid {user}"
    assert user == "10001"


def test_image_entrypoint_is_epdserve(dockerfile: list[tuple[str, str]]) -> None:
    (entrypoint,) = [rest for word, rest in final_stage(dockerfile) if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["epdserve"], "exec form, so signals reach epdserve itself"


def test_image_pins_torch_as_pyproject_does_from_the_cpu_index(dockerfile: list[tuple[str, str]]) -> None:
    args = build_args(dockerfile)
    assert args["TORCH_VERSION"] == torch_pin(), "the image's torch differs from pyproject.toml's pin"
    assert args["TORCH_INDEX_URL"] == CPU_INDEX, "the default image must be the CPU build"
    runs = [rest for word, rest in dockerfile if word == "RUN" and "torch==" in rest]
    assert runs, "no RUN installs torch"
    assert all('--index-url "${TORCH_INDEX_URL}"' in r and "${TORCH_VERSION}" in r for r in runs)


def test_image_installs_the_package_as_readme_does_from_its_build_context(dockerfile: list[tuple[str, str]]) -> None:
    # README installs the checkout with `pip install -e .`; the image installs the same project
    # directory, not editable (the source stays behind in the build stage)
    assert "pip install -e ." in (ROOT / "README.md").read_text()
    installs = [shlex.split(rest) for word, rest in dockerfile if word == "RUN" and "pip install" in rest]
    package = [cmd for cmd in installs if any(a.startswith(".") for a in cmd)]
    assert package, "no RUN pip-installs the copied project"
    assert all("-e" not in cmd and "--editable" not in cmd for cmd in package)
    # every path the build copies from the context is in it and not excluded by .dockerignore
    sources = []
    for word, rest in dockerfile:
        if word == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    assert {"pyproject.toml", "README.md", "epdserve"} <= set(sources)  # pyproject's readme, too
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    reincluded = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, ".dockerignore should exclude everything the build does not copy"
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src in reincluded, f"{src} is copied but .dockerignore leaves it out of the context"


def test_the_build_context_makes_a_wheel_with_the_embedded_model_and_the_entrypoint(tmp_path: Path) -> None:
    """What `pip install .` in the image gets: a wheel built from exactly the files the
    Dockerfile copies. The model must be inside (the image downloads nothing at run time)."""
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, context / name)
    shutil.copytree(ROOT / "epdserve", context / "epdserve", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=context,
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("epdserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "epdserve = epdserve.cli:main" in z.read(entry_points).decode()
    assets = ROOT / "epdserve" / "assets"
    model_files = {p.relative_to(ROOT).as_posix() for p in assets.rglob("*") if p.is_file()}
    assert any(f.endswith("model.safetensors") for f in model_files)
    assert model_files <= names, f"left out of the wheel: {sorted(model_files - names)}"


def test_the_images_commands_run_outside_a_container() -> None:
    """The entrypoint with the arguments the image and the manifests give it (no image here)."""
    # beside this interpreter's other console scripts, on PATH or not (a virtual environment's
    # python run by its full path)
    exe = shutil.which("epdserve") or shutil.which("epdserve", path=sysconfig.get_path("scripts"))
    assert exe, "the epdserve console script is not installed (pip install -e . installs it)"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.strip().startswith("epdserve ")
    path = subprocess.run([exe, "model-path"], capture_output=True, text=True, timeout=60, check=True)
    assert (Path(path.stdout.strip()) / "config.json").is_file()
    for role in ("router", "encoder", "serve"):
        helped = subprocess.run([exe, role, "--help"], capture_output=True, text=True, timeout=120, check=True)
        assert "--cluster-secret-file" in helped.stdout


# ---- the Kubernetes manifests --------------------------------------------------------------------


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered (kustomize is not reimplemented here)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in objects(docs, kind) if d["metadata"]["name"] == name]
    return obj


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in [*objects(docs, "Deployment"), *objects(docs, "StatefulSet")]:
        yield d["metadata"]["name"], d["spec"]["template"]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for name, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            yield name, template, c


def component(template: dict[str, Any]) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def test_the_overlays_are_the_documented_topologies() -> None:
    assert {"e-pd", "e-p-d", "aggregated", "e-vllm"} <= set(OVERLAYS)


def is_vllm(c: dict[str, Any]) -> bool:
    return bool(c.get("command") == ["vllm"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    assert {"Deployment", "Service", "NetworkPolicy"} <= {d["kind"] for d in docs}
    for doc in docs:
        for version in K8S_VERSIONS:
            # strict: an unknown field (a typo such as readinessProbes) is an error, not ignored
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_validation_rejects_a_broken_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The control: the validator above would notice a mistake."""
    deployment = copy.deepcopy(objects(rendered["e-pd"], "Deployment")[0])
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_probes_and_runs_as_non_root(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    for name, template, c in containers(rendered[overlay]):
        pod = template["spec"]
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{name}: no cpu/memory requests"
        assert "memory" in c["resources"].get("limits", {}), f"{name}: no memory limit"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        ready = c["readinessProbe"]["httpGet"]
        # the router is ready when every role behind it is (/ready); a worker when it is healthy
        assert ready["path"] == ("/ready" if component(template) == "router" else "/health"), name
        assert ready["port"] in ports, name
        alive = c["livenessProbe"]["httpGet"]
        assert alive["port"] in ports, name
        # a worker's /health fails when its engine or vision thread died: a restart cures that. The
        # router's fails while no worker is healthy, which a restart of the router cannot cure,
        # so its liveness asks /version (answered whenever its event loop runs)
        assert alive["path"] == ("/version" if component(template) == "router" else "/health"), name
        security = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        assert security.get("runAsNonRoot") is True, f"{name} may run as root"
        assert security.get("runAsUser", 0) != 0, name
        assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, name
        assert pod.get("automountServiceAccountToken") is False, f"{name} gets an API token it never uses"
        assert template["metadata"]["labels"].get("app.kubernetes.io/part-of") == "epdserve", name


def arg_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def expanded(args: list[str], c: dict[str, Any], **values: str) -> list[str]:
    """``args`` with ``$(VAR)`` replaced as the kubelet does; a variable the container does not
    declare would reach epdserve as the literal text, so that fails here."""
    declared = {e["name"] for e in c.get("env", [])}

    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in declared, f"$({m.group(1)}) is not in the container's env"
        return values[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_discovery_names_headless_services_of_the_right_pods_and_ports(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    namespace = named(docs, "Deployment", "epd-router")["metadata"]["namespace"]
    templates = dict(pod_templates(docs))
    router = named(docs, "Deployment", "epd-router")["spec"]["template"]["spec"]["containers"][0]
    args = expanded(router["args"], router, POD_NAMESPACE=namespace)
    discovered = {}
    for flag, role in (("--encoders", "encoder"), ("--pds", "pd"), ("--prefills", "prefill"), ("--decodes", "decode")):
        url = arg_value(args, flag)
        if url is None:
            continue
        if flag == "--pds" and arg_value(args, "--pd-engine") == "vllm":
            # vLLM cannot prove the cluster credential: each pod is named (a StatefulSet's stable
            # name under its headless Service), never admitted by DNS or registration
            m = re.fullmatch(rf"http://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)\.{namespace}\.svc\.cluster\.local:(\d+)", url)
            assert m, f"--pds {url} does not name a StatefulSet's pod"
            sts = named(docs, "StatefulSet", m.group(1))
            assert sts["spec"]["serviceName"] == m.group(3) and int(m.group(2)) < sts["spec"]["replicas"]
            service = named(docs, "Service", m.group(3))
            assert service["spec"].get("clusterIP") == "None" and int(m.group(4)) in {
                p["port"] for p in service["spec"]["ports"]
            }
            assert selects({"matchLabels": service["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])
            discovered[role] = m.group(3)
            continue
        m = re.fullmatch(rf"dns\+http://([a-z0-9-]+)\.{namespace}\.svc\.cluster\.local:(\d+)", url)
        assert m, f"{flag} {url} is not a dns+http URL of a Service in the namespace"
        service = named(docs, "Service", m.group(1))
        assert service["spec"].get("clusterIP") == "None", f"{m.group(1)} is not headless: DNS gives one VIP"
        assert int(m.group(2)) in {p["port"] for p in service["spec"]["ports"]}
        # a Service's selector is matchLabels alone
        pods = [
            n
            for n, t in templates.items()
            if selects({"matchLabels": service["spec"]["selector"]}, t["metadata"]["labels"])
        ]
        assert [component(templates[n]) for n in pods] == [role], f"{m.group(1)} selects {pods}"
        discovered[role] = m.group(1)
    # every worker Deployment is discovered, and every Service but the router's is for discovery
    roles = {component(t) for t in templates.values()} - {"router"}
    assert set(discovered) == roles
    for service in objects(docs, "Service"):
        if service["metadata"]["name"] != "epd-router":
            assert service["metadata"]["name"] in discovered.values()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_opens_the_router_to_all_and_the_workers_to_the_deployment_only(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    policies = objects(docs, "NetworkPolicy")
    templates = dict(pod_templates(docs))

    def rules_for(labels: dict[str, str]) -> list[dict[str, Any]]:
        chosen = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert chosen, f"no NetworkPolicy selects pods labelled {labels}: all ingress is open"
        assert all("Ingress" in p["spec"]["policyTypes"] for p in chosen)
        return [rule for p in chosen for rule in p["spec"].get("ingress", [])]

    for name, template in templates.items():
        labels = template["metadata"]["labels"]
        rules = rules_for(labels)
        container_ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        allowed = {p["port"] for rule in rules for p in rule.get("ports", [])}
        assert all(rule.get("ports") for rule in rules), f"{name}: a rule opens every port"
        assert container_ports <= allowed, f"{name}: ports {container_ports - allowed} unreachable"
        if component(template) == "router":
            assert allowed == {8000}, "the router's only open port is the public one"
            assert any("from" not in rule for rule in rules), "the public endpoint is for anyone"
            continue
        assert component(template) in WORKER_ROLES
        for rule in rules:
            peers = rule.get("from")
            assert peers, f"{name}: a rule admits anyone"
            for peer in peers:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    # the deployment's own pods, this namespace
                    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/part-of": "epdserve"}}
                else:
                    # the metrics scraper's namespace: HTTP ports only, not the connectors'
                    assert set(peer) == {"namespaceSelector"}
                    assert {p["port"] for p in rule["ports"]} <= {8001, 8002}
        # every pod a worker is called by carries the label the policy admits
        for other in templates.values():
            assert other["metadata"]["labels"]["app.kubernetes.io/part-of"] == "epdserve"


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "aggregated"])
def test_the_encoder_hpa_scales_on_the_encoder_load_ratio(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    (hpa,) = objects(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "epd-encoder")
    assert component(named(docs, "Deployment", target["name"])["spec"]["template"]) == "encoder"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "epd_encoder_load_ratio"
    # 0.8 per pod: ceil(sum / 0.8) pods, the router's epd_router_recommended_replicas{role="encoder"}
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_no_secret_is_rendered_and_the_example_holds_only_placeholders(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, docs in rendered.items():
        assert not objects(docs, "Secret"), f"{overlay} applies a Secret: it would overwrite the operator's"
    example = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(example, version, strict=True)
    values = example["stringData"]
    assert set(values) == {"EPD_CLUSTER_SECRET", "EPD_ADMIN_KEY", "EPD_API_KEY"}
    assert set(values.values()) == {"REPLACE-ME"}
    with pytest.raises(CredentialError):  # used as it is, the roles refuse to start
        ClusterCredential.from_text(values["EPD_CLUSTER_SECRET"])
    # every reference to the Secret names it and a key it has
    for docs in rendered.values():
        for name, template, c in containers(docs):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert (ref["name"], ref["key"] in values) == (example["metadata"]["name"], True), name
            for v in template["spec"].get("volumes", []):
                if "secret" in v:
                    assert v["secret"]["secretName"] == example["metadata"]["name"]
                    assert v["secret"]["defaultMode"] & 0o004 == 0, "epdserve refuses a world-readable secret"
                    assert {i["key"] for i in v["secret"]["items"]} <= set(values)


def role_config(c: dict[str, Any], secret_file: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The role's config as epdserve's own CLI builds it in the pod from the container's args and
    environment (secrets: fresh values)."""
    for env in ("EPD_CLUSTER_SECRET", "EPD_ADMIN_KEY", "EPD_API_KEY"):
        monkeypatch.delenv(env, raising=False)  # only what the pod gets
    for e in c.get("env", []):
        if "secretKeyRef" in e.get("valueFrom", {}):
            monkeypatch.setenv(e["name"], ClusterCredential.generate().secret.decode())
    args = expanded(c["args"], c, POD_IP=POD_IP, POD_NAMESPACE="epd")
    args = [f"--cluster-secret-file={secret_file}" if a.startswith("--cluster-secret-file") else a for a in args]
    ns, unknown = build_parser().parse_known_args(args)
    assert not unknown, f"epdserve {args[0]} does not know {unknown}"
    builders = {"router": router_config, "encoder": encoder_config, "serve": serve_config}
    return builders[args[0]](ns)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_command_line_builds_its_role_config(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifests' args through the CLI that parses them in the pod (flags, values, the
    config dataclasses' validation), and what they must configure across pods: addresses peers
    can dial, the tcp connectors, no vision weights behind encoders, registration with the
    router, shm only where /dev/shm is mounted."""
    secret = tmp_path / "cluster-secret"
    secret.write_text(ClusterCredential.generate().secret.decode())
    secret.chmod(0o600)
    docs = rendered[overlay]
    has_encoders = any(component(t) == "encoder" for _, t in pod_templates(docs))
    for _, _, c in containers(docs):
        if is_vllm(c):
            check_vllm_container(c, docs)
    built = [(name, t, role_config(c, secret, monkeypatch)) for name, t, c in containers(docs) if not is_vllm(c)]
    for name, template, config in built:
        role = component(template)
        assert config.host == "0.0.0.0", f"{name} must listen on the pod's interfaces"
        uses_shm = False
        if role == "router":
            uses_shm = config.frontend.enabled  # its pixel slab
            assert config.dispatch == ("always" if has_encoders else "never")
            assert config.auth.admin_key, "the router accepts no registration without its admin key"
            assert config.auth.api_key, "the public API would be open"
        else:
            # peers dial the pod's IP (from the downward API), and the worker registers and beats
            assert config.registration.advertise_host == POD_IP, name
            assert config.registration.register_with == "http://epd-router:8000", name
            assert config.registration.admin_key, name
        if role == "encoder":
            assert config.ec.connector == "tcp", "shm handles are unreadable from another pod"
            assert (config.ec.advertise_host, config.ec.tcp_port) == (POD_IP, 9001)
            uses_shm = config.ec.connector == "shm"
        elif role != "router":
            assert config.vision is not has_encoders, f"{name}: vision weights only where nothing encodes"
            assert config.auth.internal_only, f"{name} would serve anyone who reaches it"
            assert config.role == {"pd": "both", "prefill": "prefill", "decode": "decode"}[role]
            if config.role != "both":
                assert config.kv.connector == "tcp", "KV crosses pods"
                uses_shm = config.kv.connector == "shm"
            if config.role == "prefill":
                assert (config.kv.advertise_host, config.kv.tcp_port) == (POD_IP, 9002)
        if uses_shm:
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            mounts = {m["mountPath"]: m["name"] for c in template["spec"]["containers"] for m in c["volumeMounts"]}
            assert "/dev/shm" in mounts, f"{name} uses a shm connector without a /dev/shm volume"
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def check_vllm_container(c: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """A vLLM language-model worker's command line (vLLM's parser is not here: what epdserve and
    the router rely on): epdserve's connector with a config it accepts, the served name the
    encoders sign handles with, the pod's address, one tensor-parallel rank per GPU requested."""
    from epdserve.integrations.vllm.config import VllmECConfig
    from epdserve.integrations.vllm.launch import CONNECTOR

    args = c["args"]
    assert args[0] == "serve" and not args[1].startswith("-"), "vllm serve MODEL ..."
    assert arg_value(args, "--host") == "0.0.0.0"
    assert int(arg_value(args, "--port") or 0) in {p["containerPort"] for p in c["ports"]}
    config = json.loads(arg_value(args, "--ec-transfer-config") or "{}")
    assert {k: config[k] for k in CONNECTOR} == CONNECTOR
    ec = VllmECConfig.from_extra(config["ec_connector_extra_config"])  # unknown keys are refused
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert ec.cluster_secret_file and str(Path(ec.cluster_secret_file).parent) in mounts
    gpus = c["resources"]["requests"]["nvidia.com/gpu"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus, "extended resources: request = limit"
    assert arg_value(args, "--tensor-parallel-size") == gpus
    assert "/dev/shm" in mounts, "vLLM's workers share tensors through /dev/shm"
    served = {arg_value(e["args"], "--served-model-name") for _, _, e in containers(docs) if not is_vllm(e)}
    assert arg_value(args, "--served-model-name") == "shapes-qwen2vl" and served <= {None}, (
        "the encoders serve the embedded model under its directory name: vLLM must use the same"
    )
