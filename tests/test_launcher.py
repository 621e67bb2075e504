"""`imerge launch`: a whole job on one host, as real processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

IMERGE = [sys.executable, "-m", "imerge"]


def launch(tmp_path: Path, *args: str, extra_env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")} | (extra_env or {})
    return subprocess.Popen(IMERGE + ["launch", "--log-dir", str(tmp_path / "logs"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


STAGES = ("waiting for the shards", "waiting for the workers", "waiting for the coordinator's plan", "worker 0 creates",
          "profiling", "training")


def test_launch_two_shards_two_workers_completes(tmp_path):
    summary = tmp_path / "summary.json"
    run = launch(tmp_path, "--shards", "2", "--workers", "2", "--model", "digits-cnn", "--data", "digits",
                 "--iters", "25", "--summary-json", str(summary), "--trace-dir", str(tmp_path / "trace"),
                 "--fusion", "size", "--slots", "ack", "--slot-width", "1", "--interleave-period", "2")
    output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output
    result = json.loads(summary.read_text())
    assert result["iterations"] == 25 and result["shards"] == 2 and result["workers"] == 2
    assert result["final_loss"] < 2.35 and result["test_accuracy"] is not None
    assert "finished" in output
    stages = [line.strip() for line in output.splitlines() if line.startswith(STAGES)]  # what startup waits for
    assert stages[0] == "waiting for the shards to serve (0/2 registered)" and stages[-1] == "training", output
    order = [next(i for i, stage in enumerate(STAGES) if line.startswith(stage)) for line in stages]
    assert order == sorted(order), stages
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["checkpoints", "coordinator.log", "ports", "prometheus.yml", "ps0.log", "ps1.log", "roles.json",
                    "state.safetensors", "worker0.log", "worker1.log"]  # state.safetensors: for --resume
    ports = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "logs" / "ports").glob("*.json")}
    assert sorted(ports) == ["coordinator", "ps0", "ps1", "worker0", "worker1"]  # each bound port 0, reported it
    assert all(ports[f"ps{i}"]["grpc"] > 0 for i in (0, 1)) and all(p["metrics"] > 0 for p in ports.values())
    roles = json.loads((tmp_path / "logs" / "roles.json").read_text())
    assert sorted(roles) == ["coordinator", "ps0", "ps1", "worker0", "worker1"]
    for role in roles:  # every endpoint on loopback only
        log = (tmp_path / "logs" / f"{role}.log").read_text()
        assert f"metrics on http://127.0.0.1:{ports[role]['metrics']}/metrics" in log, role
    scrape = yaml.safe_load((tmp_path / "logs" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert sorted(c["labels"]["role"] for c in scrape["static_configs"]) == \
        ["coordinator", "ps0", "ps1", "worker0", "worker1"]
    for rank in (0, 1):  # Chrome trace JSON that Perfetto opens
        trace = json.loads((tmp_path / "trace" / f"worker{rank}.json").read_text())
        categories = {e.get("cat") for e in trace["traceEvents"]}
        assert {"compute", "push", "pull", "flag-wait"} <= categories
        assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


def test_a_profiling_start_says_so_until_the_plan_is_chosen(tmp_path):
    run = launch(tmp_path, "--shards", "1", "--workers", "2", "--model", "digits-cnn", "--data", "digits",
                 "--iters", "8", "--fusion", "cost", "--profile-iters", "3")
    output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output
    stages = [line.strip() for line in output.splitlines() if line.startswith(STAGES)]
    assert stages[0] == "waiting for the shards to serve (0/1 registered)", output
    assert stages[-2:] == ["profiling until iteration 3, then choosing the plan", "training"], output


def test_startup_line_follows_the_jobs_order():
    from imerge.ops.startup import Startup, stage_line, waiting_for

    assert waiting_for(Startup(1, 2, 0, 2, 0, False)) == "waiting for the shards to serve (1/2 registered)"
    assert waiting_for(Startup(2, 2, 1, 2, 0, False)) == "waiting for the workers to join (1/2)"
    assert waiting_for(Startup(2, 2, 2, 2, 0, False)) == "waiting for the coordinator's plan"
    assert waiting_for(Startup(2, 2, 2, 2, 1, False)) == "worker 0 creates the blocks on the shards"
    assert waiting_for(Startup(2, 2, 2, 2, 1, True)) == "training"  # a script need not report its iterations
    assert stage_line({"event": "stage", "stage": "profiling", "until": 5}) == \
        "profiling until iteration 5, then choosing the plan"
    assert stage_line({"event": "stage", "stage": "training"}) == "training"


def test_sigint_mid_run_leaves_no_process(tmp_path):
    run = launch(tmp_path, "--shards", "2", "--workers", "2", "--model", "digits-cnn", "--iters", "1000000")
    worker_log = tmp_path / "logs" / "worker1.log"
    deadline = time.monotonic() + 180
    while not (worker_log.exists() and "iteration=3 " in worker_log.read_text()):
        assert run.poll() is None, run.stdout.read()
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.5)
    children = descendants(run.pid)
    assert len(children) >= 6  # redis, coordinator, 2 shards, 2 workers
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGINT, output
    assert "SIGINT: stopping every role" in output
    time.sleep(0.5)
    assert [pid for pid in children if alive(pid)] == []


def test_failed_role_is_named_and_exit_is_nonzero_once_its_restarts_are_exhausted(tmp_path):
    script = "import os, sys; sys.exit(3 if os.environ['IMERGE_RANK'] == '1' else 0)"
    started = time.monotonic()
    run = launch(tmp_path, "--shards", "1", "--workers", "2", "--max-restarts", "1", "--", sys.executable, "-c",
                 script)
    output, _ = run.communicate(timeout=120)
    assert run.returncode == 1
    text = " ".join(output.split())
    assert "worker1 exited with code 3 (restart 1 of 1)" in text
    assert "failed: worker1: exited with code 3 after 1 restarts (--max-restarts 1)" in text
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("args, env, message", [
    (["ps", "--port", "70000"], {}, "--port: must be 0..65535"),
    (["ps"], {"IMERGE_PORT": "abc"}, "IMERGE_PORT (environment twin of --port): expected int, got 'abc'"),
    (["launch", "--workers", "0"], {}, "--workers: must lie in 1..256"),
    (["worker", "--world-size", "2", "--rank", "5"], {}, "--rank: must lie in 0..1"),
    (["coordinator", "--redis-url", "http://x"], {}, "--redis-url: expected redis://host:port/db"),
    (["worker", "--model", "alexnet"], {}, "argument --model: invalid choice: 'alexnet'"),
    (["ps", "--", "python"], {}, "only accepted by 'imerge launch'"),
    (["bench", "B4", "--sizes", "1,x"], {}, "--sizes: must be comma-separated worker counts"),
    (["testbed", "--mtu", "100"], {}, "--mtu: must be within 576..65000"),
    (["launch", "--model", "resnet18", "--", "python", "s.py"], {}, "--model: is an option of the built-in job"),
    (["launch", "--", "missing-command", "x"], {}, "no such command: missing-command (the command after --"),
])
def test_cli_rejects_bad_options_naming_them(args, env, message, monkeypatch, capsys):
    from helpers import run_cli

    code, stderr = run_cli(args, env, monkeypatch, capsys)
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr


def test_shard_stops_gracefully_on_sigterm(redis_url):
    shard = subprocess.Popen(IMERGE + ["ps", "--redis-url", redis_url, "--job", "sigterm", "--no-register"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    lines = []
    while not any("serving on" in line for line in lines):
        assert time.monotonic() < deadline and shard.poll() is None, "".join(lines)
        lines.append(shard.stdout.readline())
    shard.send_signal(signal.SIGTERM)
    assert shard.wait(15) == 0


SCRIPT = """
import torch, imerge
spec = imerge.OptimizerSpec.from_env(imerge.OptimizerSpec("sgd", lr=0.05, momentum=0.9)) if {from_env} else \\
    imerge.OptimizerSpec("sgd", lr=0.05, momentum=0.9)
model = imerge.distribute(torch.nn.Linear(4, 2), spec)
print("trains with", model.optimizer.spec.name, model.optimizer.param_groups[0]["lr"], flush=True)
model(torch.ones(1, 4)).sum().backward()
model.close()
"""


def test_resume_continues_a_finished_run_exactly_like_an_uninterrupted_one(tmp_path):
    """6 iterations (state saved at 3 and at the end), resumed to 10, equal 10 uninterrupted ones."""
    from safetensors.torch import load_file
    import torch

    common = ["--shards", "1", "--workers", "2", "--no-evaluate", "--samples", "256",
              "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.01"]

    def start(name: str, *args: str) -> subprocess.Popen:
        return launch(tmp_path / name, *common, *args, "--save", str(tmp_path / f"{name}.safetensors"))

    def result(name: str, process: subprocess.Popen) -> dict:
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output
        return load_file(str(tmp_path / f"{name}.safetensors"))

    first, uninterrupted = start("first", "--iters", "6", "--state-every", "3"), start("uninterrupted", "--iters", "10")
    result("first", first)  # the two run at once (each has its own Redis and ports)
    uninterrupted = result("uninterrupted", uninterrupted)
    assert (tmp_path / "first" / "logs" / "state.safetensors").is_file()
    resumed = result("resumed", start("resumed", "--iters", "10", "--resume", str(tmp_path / "first" / "logs")))
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.timeout(300)
def test_a_finished_job_name_is_refused_at_once(tmp_path):
    from imerge.ops.redis_server import RedisServer

    redis = RedisServer()
    try:
        job = ["--job", "reused", "--redis-url", redis.url, "--shards", "1", "--workers", "1", "--iters", "2",
               "--no-evaluate"]
        first = launch(tmp_path / "first", *job)
        output, _ = first.communicate(timeout=240)
        assert first.returncode == 0, output
        started = time.monotonic()
        again = launch(tmp_path / "again", *job)
        output, _ = again.communicate(timeout=120)
        assert again.returncode == 1 and time.monotonic() - started < 10, output
        assert "job reused already finished" in " ".join(output.split()) and "--fresh" in output, output
    finally:
        redis.stop()


def test_console_lines_never_read_a_roles_text_as_markup():
    """A role's error may quote a gRPC method path ([/imerge.v1.ParameterServer/Pull]): printed as it is."""
    import io

    from rich.console import Console

    from imerge.ops.launch import LaunchConfig, Launcher

    out = io.StringIO()
    launcher = Launcher(LaunchConfig(), {}, console=Console(file=out, width=200))
    launcher._say("red", "ps0: failed [/imerge.v1.ParameterServer/Pull] [bold]x[/bold]")
    assert "ps0: failed [/imerge.v1.ParameterServer/Pull] [bold]x[/bold]" in out.getvalue()


TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist, imerge
from torch.utils.data import DistributedSampler
dist.init_process_group("gloo")  # the script's own process group, from torchrun's variables
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
sampled = list(DistributedSampler(range(8), shuffle=False))
model = imerge.distribute(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.ones(2, 4)).pow(2).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.log_loss(loss, total=3)
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "local", os.environ["LOCAL_RANK"],
      os.environ["LOCAL_WORLD_SIZE"], "sum", total.item(), "sampled", sampled, flush=True)
dist.destroy_process_group()
"""  # and no model.close(): the script ends, IMerge leaves the job at exit


NPROC_SCRIPT = ("import torch, imerge\n"
                "model = imerge.distribute(torch.nn.Linear(4, 2))\n"
                "print('local rank', model.config.local_rank, flush=True)\n"
                "print('torch threads', torch.get_num_threads(), flush=True)\n"
                "model(torch.ones(1, 4)).sum().backward()\n"
                "model.close()\n")
SCRIPT_RUNS = {  # short launches of a script that the tests below read, started together (each has its own Redis
    # and ports): their processes mostly wait on each other, so together they take about as long as the slowest
    "flags read": ("--shards", "1", "--workers", "2", "--optimizer", "adam", "--lr", "0.3", "--", sys.executable,
                   "-c", SCRIPT.format(from_env=True)),
    "flags overridden": ("--shards", "1", "--workers", "1", "--max-restarts", "0", "--optimizer", "adam", "--lr",
                         "0.3", "--", sys.executable, "-c", SCRIPT.format(from_env=False)),
    "nproc per node": ("--shards", "1", "--workers", "3", "--nproc-per-node", "2", "--", sys.executable, "-c",
                       NPROC_SCRIPT),
    "torchrun variables": ("--shards", "1", "--workers", "2", "--summary-json", "{dir}/summary.json", "--",
                           sys.executable, "-c", TORCHRUN_SCRIPT),
    "threads chosen": ("--shards", "1", "--workers", "2", "--", sys.executable, "-c", NPROC_SCRIPT),
    "failure repeats": ("--shards", "1", "--workers", "2", "--max-restarts", "5", "--", sys.executable, "-c",
                        "import os; os.environ['IMERGE_RANK'] == '1' and os.environ['A_VARIABLE_NOBODY_SET']"),
    "never joins": ("--shards", "1", "--workers", "1", "--", sys.executable, "-c", "print('no job here')"),
    "fails after finishing": ("--shards", "1", "--workers", "2", "--", sys.executable, "-c",
                              NPROC_SCRIPT + "import os; os._exit(3 if os.environ['IMERGE_RANK'] == '1' else 0)\n"),
}

CORES = os.cpu_count() or 1
SHARE_OF_TWO = max(1, CORES // 2)  # what the launcher gives each of 2 workers; torch takes at most the cores
CHOSEN_THREADS = SHARE_OF_TWO + 1 if SHARE_OF_TWO < CORES else SHARE_OF_TWO - 1  # another count torch keeps
SCRIPT_ENV = {"threads chosen": {"OMP_NUM_THREADS": str(CHOSEN_THREADS)}}


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """name -> (exit code, output, its folder) of each of SCRIPT_RUNS, all launched at once."""
    started = {}
    for name, args in SCRIPT_RUNS.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "-"))
        started[name] = (launch(folder, *(arg.replace("{dir}", str(folder)) for arg in args),
                                extra_env=SCRIPT_ENV.get(name)), folder)
    runs = {}
    for name, (run, folder) in started.items():
        output, _ = run.communicate(timeout=300)
        runs[name] = (run.returncode, output, folder)
    return runs


def test_launch_flags_reach_a_script_that_reads_them_and_its_output_is_prefixed_with_its_rank(script_runs):
    code, output, folder = script_runs["flags read"]
    assert code == 0, output
    assert "[rank0]: trains with adam 0.3" in output and "[rank1]: trains with adam 0.3" in output
    assert "trains with adam 0.3" in (folder / "logs" / "worker1.log").read_text()


def test_launch_flags_that_a_script_overrides_are_refused_naming_them(script_runs):
    code, output, _ = script_runs["flags overridden"]
    assert code == 1, output
    assert "--lr 0.3 --optimizer adam: imerge launch was given these optimizer flags" in output
    assert "trains with" not in output


def test_nproc_per_node_gives_each_worker_its_local_rank(script_runs):
    code, output, _ = script_runs["nproc per node"]
    assert code == 0, output
    assert {"[rank0]: local rank 0", "[rank1]: local rank 1", "[rank2]: local rank 0"} <= set(output.splitlines())


def test_the_workers_of_one_host_share_its_cores_as_torchrun_shares_them(script_runs):
    """torch's default, every core per process, leaves several workers' OpenMP threads spinning on each other's
    cores (a small GPT on two cores: 0.189 s/it against 0.019 with its share): each worker gets the host's cores
    divided by the workers (at least one) unless OMP_NUM_THREADS says otherwise."""
    from imerge.ops.launch import worker_threads

    code, output, _ = script_runs["nproc per node"]  # 3 workers
    share = max(1, (os.cpu_count() or 1) // 3)
    assert worker_threads(3) == share and worker_threads(10_000) == 1
    assert sum(line.endswith(f"torch threads {share}") for line in output.splitlines()) == 3, output
    assert f"OMP_NUM_THREADS={share} each" in output


def test_the_users_own_thread_count_is_kept(script_runs):
    """OMP_NUM_THREADS in the launcher's environment reaches the workers unchanged."""
    if CHOSEN_THREADS < 1:
        pytest.skip("one core: no thread count other than the launcher's share to choose")
    code, output, _ = script_runs["threads chosen"]
    assert code == 0, output
    assert sum(line.endswith(f"torch threads {CHOSEN_THREADS}") for line in output.splitlines()) == 2, output
    assert "OMP_NUM_THREADS=" not in output  # no line about a share the launcher did not choose


def test_a_script_gets_torchruns_variables_and_ends_without_close(script_runs):
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun gives them: the
    script's own process group, all_reduce and DistributedSampler work beside IMerge; it never calls close(), and
    leaves cleanly at exit (exit 0, no restart); model.log_loss feeds the launcher's summary."""
    code, output, folder = script_runs["torchrun variables"]
    assert code == 0, output
    assert "[rank0]: rank 0 of 2 local 0 2 sum 1.0 sampled [0, 2, 4, 6]" in output
    assert "[rank1]: rank 1 of 2 local 1 2 sum 1.0 sampled [1, 3, 5, 7]" in output
    assert "Traceback" not in output and "restarting" not in output
    result = json.loads((folder / "summary.json").read_text())
    assert result["iterations"] == 3 and result["final_loss"] is not None and result["restarts"] == 0


def test_a_failure_that_repeats_is_not_restarted_again_and_each_restart_is_one_line(script_runs):
    code, output, _ = script_runs["failure repeats"]
    assert code == 1, output
    assert output.count("restarting it") == 1, output
    assert "worker1: failed twice the same way (exit code 1: KeyError: 'A_VARIABLE_NOBODY_SET'); not restarted " \
           "again" in " ".join(output.split()), output


def test_a_worker_script_that_never_joins_fails_the_job(script_runs):
    code, output, _ = script_runs["never joins"]
    assert code == 1, output
    assert "worker0: exited with code 0 without finishing its part of the job: it never joined it" in \
        " ".join(output.split()), output


def test_a_worker_that_fails_after_finishing_its_part_is_not_restarted_into_the_finished_job(script_runs):
    """Its last round is on the shards; a restart would wait for a generation that never comes (minutes): the
    launch fails at once, naming what happened."""
    code, output, _ = script_runs["fails after finishing"]
    assert code == 1, output
    assert "worker1: exited with code 3 after it finished its part of the job" in " ".join(output.split()), output
    assert "restarting it" not in output, output


def test_under_torchrun_its_rank_decides_over_the_pods(cluster, tmp_path):
    """A pod of the chart carries IMERGE_RANK for itself; torchrun inside it starts a process per GPU, each with
    its own RANK: torchrun's decides (no RankInUse), and an IMERGE_WORLD_SIZE that disagrees is refused."""
    from imerge.core.errors import ConfigError
    from imerge.ops.redis_server import free_port
    from imerge.worker.config import torchrun_identity

    c = cluster(2, 1)
    script = ("import os, torch, imerge\n"
              "model = imerge.distribute(torch.nn.Linear(4, 2), imerge.OptimizerSpec('sgd', lr=0.1))\n"
              "model(torch.ones(1, 4)).sum().backward()\n"
              "line = f'joined as {model.config.rank} of {model.config.world_size}\\n'\n"
              "os.write(1, line.encode())\n")  # one write each: two processes share the pipe
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}, "IMERGE_JOB": c.job,
           "IMERGE_REDIS_URL": c.redis_url, "IMERGE_RANK": "0", "IMERGE_WORLD_SIZE": "2"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "--no-python", sys.executable, "-c", script],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "joined as 0 of 2" in run.stdout and "joined as 1 of 2" in run.stdout
    with pytest.raises(ConfigError, match="IMERGE_WORLD_SIZE is 4 but torchrun's WORLD_SIZE is 2"):
        torchrun_identity({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "IMERGE_WORLD_SIZE": "4"})
    assert torchrun_identity({"RANK": "1", "WORLD_SIZE": "2"}) == {}  # not under torchrun: IMERGE_* decide


@pytest.mark.timeout(300)
def test_a_second_launch_under_a_running_jobs_name_is_refused_before_it_touches_the_job(tmp_path):
    """On a shared Redis, a second run under the running job's name: its coordinator, shards and workers each
    refuse the job (another run's token holds its lease) before writing anything of it; the first run goes on
    undisturbed and finishes."""
    from imerge.control.store import Store
    from imerge.ops.redis_server import RedisServer

    redis = RedisServer()
    try:
        job = ["--job", "shared", "--redis-url", redis.url, "--shards", "1", "--workers", "1", "--no-evaluate",
               "--model", "digits-cnn", "--data", "digits", "--max-restarts", "0"]
        first = launch(tmp_path / "first", *job, "--iters", "250")
        store = Store(redis.url, "shared")
        deadline = time.monotonic() + 120
        while not store.job_running():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.3)
        addresses = store._redis.hgetall(store._key("shards"))
        started = time.monotonic()
        second = launch(tmp_path / "second", *job, "--iters", "5")
        output, _ = second.communicate(timeout=120)
        assert second.returncode == 1 and time.monotonic() - started < 30, output
        assert "job shared is running in this Redis under another run" in " ".join(output.split()), output
        assert store._redis.hgetall(store._key("shards")) == addresses  # its shards registered nothing
        first_output, _ = first.communicate(timeout=240)
        assert first.returncode == 0, first_output
        store.close()
    finally:
        redis.stop()


def test_imerge_worker_runs_a_script_once_per_gpu_with_torchruns_variables():
    """What a chart pod of workers.gpu.count 2 runs for workers.command: a process per GPU, each its own rank."""
    script = ("import os; print('process', *(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
              "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'IMERGE_RANK')), flush=True)")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}, "MASTER_ADDR": "w0.svc",
           "MASTER_PORT": "29511"}
    run = subprocess.run(IMERGE + ["worker", "--nproc-per-node", "2", "--world-size", "4", "--node-rank", "1",
                                   "--", sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {"process 2 0 4 2 1 w0.svc 29511 2", "process 3 1 4 2 1 w0.svc 29511 3"} <= set(run.stdout.splitlines())
