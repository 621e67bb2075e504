"""``python -m imerge.ops.deploygen``: write every derived file under deploy/ from its one source.

* the Grafana dashboards (``imerge.ops.dashboards``) into deploy/grafana/dashboards/ and the Helm chart;
* the recording rules (deploy/prometheus/rules.yml) into the Helm chart;
* both into the package (``imerge/telemetry/share/``), so that an installed wheel ships them;
* the chart's ``values.schema.json`` and its README's parameter table, from ``values.yaml``
  (:mod:`imerge.ops.chartdoc`);
* compose's Prometheus configuration (``imerge.metrics.prometheus_config``);
* the plain Kubernetes manifests, rendered from the Helm chart (needs ``helm-python-sdk``).

``--check`` writes nothing and exits 1 naming the stale files (the tests run it).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from imerge.ops.chartdoc import readme_with_params, values_schema
from imerge.ops.dashboards import render as render_dashboards
from imerge.telemetry.metrics import prometheus_config

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "k8s" / "imerge"
PACKAGE_SHARE = ROOT / "src" / "imerge" / "telemetry" / "share"
COMPOSE_ROLES = ("coordinator", "ps0", "ps1", "worker0", "worker1")
COMPOSE_METRICS_PORT = 9400
# The plain manifests: release "imerge", the Redis password from a Secret the user creates first.
MANIFEST_VALUES = {"redis": {"auth": {"existingSecret": "imerge-redis"}}}
MANIFEST_HEADER = """\
# Rendered from deploy/k8s/imerge by `python -m imerge.ops.deploygen` (helm template, default values);
# do not edit. Create the Redis password first, then apply into your namespace:
#   kubectl create secret generic imerge-redis --from-literal=redis-password="$(openssl rand -hex 24)"
#   kubectl apply -f imerge.yaml
"""


def render_manifests(values: dict[str, Any] | None = None, name: str = "imerge", namespace: str = "default") -> dict[str, str]:
    """Template path -> rendered manifest of the Helm chart (offline)."""
    import helm_python

    return helm_python.Chart.load(CHART).render(values, name=name, namespace=namespace)


def plain_manifests() -> str:
    rendered = render_manifests(MANIFEST_VALUES)
    documents = [text.strip() for path, text in sorted(rendered.items())
                 if path.endswith(".yaml") and text.strip() and "/tests/" not in path]  # helm test hooks: not applied
    return MANIFEST_HEADER + "---\n" + "\n---\n".join(documents) + "\n"


MANIFESTS = DEPLOY / "k8s" / "manifests" / "imerge.yaml"


def derived_files() -> dict[Path, str]:
    """The generated files but the plain manifests (rendered from the chart once these are written)."""
    files: dict[Path, str] = {}
    for name, text in render_dashboards().items():
        files[DEPLOY / "grafana" / "dashboards" / name] = text
        files[CHART / "dashboards" / name] = text
        files[PACKAGE_SHARE / "dashboards" / name] = text
    values = (CHART / "values.yaml").read_text()
    files[CHART / "values.schema.json"] = values_schema(values)
    files[CHART / "README.md"] = readme_with_params((CHART / "README.md").read_text(), values)
    rules = (DEPLOY / "prometheus" / "rules.yml").read_text()
    files[CHART / "files" / "rules.yml"] = rules
    files[PACKAGE_SHARE / "rules.yml"] = rules
    files[DEPLOY / "compose" / "prometheus.yml"] = prometheus_config(
        {role: f"{role}:{COMPOSE_METRICS_PORT}" for role in COMPOSE_ROLES}, "demo",
        Path("/etc/prometheus/rules.yml"), interval_s=5)
    return files


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    # the manifests last, rendered once the chart's own copies (dashboards, rules) are written
    for path, make in [*((p, lambda t=t: t) for p, t in derived_files().items()), (MANIFESTS, plain_manifests)]:
        text = make()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(path.relative_to(ROOT)))
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if check and stale:
        print("stale (run python -m imerge.ops.deploygen): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("wrote " if stale else "up to date: nothing to write ") + ", ".join(stale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
