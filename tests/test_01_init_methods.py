"""01_init_methods.py under every launcher, and its bad-input errors."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import time

import pytest
import torch

from launch import (
    PYTHON,
    REPO,
    Watched,
    exit_hook_env,
    forked,
    free_port,
    hooks_that_ran,
    load_script,
    run,
    run_many,
)

SCRIPT = "01_init_methods.py"
BAD_LAUNCH = "invalid"  # the shared setup()'s words
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)\s+(\w+)\s+(\S+)\s*$", re.M)


def table(stdout: str) -> list[dict]:
    return [
        dict(
            rank=int(m[1]),
            local_rank=int(m[2]),
            node_rank=int(m[3]),
            world_size=int(m[4]),
            pid=int(m[6]),
            backend=m[7],
            device=m[8],
        )
        for m in ROW.finditer(stdout)
    ]


def expected_summary(ws: int) -> str:
    halves = [list(range(0, ws, 2)), list(range(1, ws, 2))][: min(ws, 2)]  # even, odd ranks
    return (
        f"all_reduce sum={ws * (ws - 1) // 2}, all_gather={list(range(ws))}, broadcast=1000, "
        f"all_reduce in groups {halves}: sums {[sum(h) for h in halves]}"
    )


def assert_one_node_job(stdout: str, ws: int, scheme: str = "env") -> None:
    rows = table(stdout)
    assert [r["rank"] for r in rows] == list(range(ws)), stdout
    assert [r["local_rank"] for r in rows] == list(range(ws))
    assert {r["node_rank"] for r in rows} == {0}
    assert {r["world_size"] for r in rows} == {ws}
    assert {(r["backend"], r["device"]) for r in rows} == {("gloo", "cpu")}
    assert len({r["pid"] for r in rows}) == ws  # really separate processes
    last = stdout.strip().splitlines()[-1]
    assert last == f"verified: {ws} rank(s) joined via {scheme}://; {expected_summary(ws)}"


def test_single_process_is_a_world_of_one():
    r = run(SCRIPT).ok()
    assert "world_size=1" in r.stdout
    assert_one_node_job(r.stdout, 1)


def test_torchrun_ranks_and_collectives(tmp_path):
    # (a world of one is the plain launch above; under torchrun it takes the same path as 3)
    r = run(SCRIPT, launcher="torchrun", nproc=3, env=exit_hook_env(tmp_path)).ok()
    assert_one_node_job(r.stdout, 3)
    # the same launch proves a promise of the shared plumbing (tests/test_plumbing.py): the
    # program's exit hooks ran on every rank, although each ends with os._exit
    assert hooks_that_ran(tmp_path) == ["rank0", "rank1", "rank2"]


def test_tcp_without_rank_is_a_world_of_one_like_env():
    # forked: one process, no launcher, as `python 01_init_methods.py --init-method tcp://...`
    r = forked(SCRIPT, "--init-method", f"tcp://127.0.0.1:{free_port()}", timeout=60).ok()
    assert_one_node_job(r.stdout, 1, "tcp")


def test_spawn_with_tcp_init_passes_ranks_itself():
    # with env:// under --spawn: the other scripts' spawn tests
    r = run(
        SCRIPT, "--init-method", f"tcp://127.0.0.1:{free_port()}", launcher="spawn", nproc=2
    ).ok()
    assert_one_node_job(r.stdout, 2, "tcp")


def test_backend_gloo_under_env_joins_through_its_own_path():
    # --backend gloo joins in 01's join(), not the shared setup(), for env:// too
    r = run(SCRIPT, "--backend", "gloo", launcher="spawn", nproc=2).ok()
    assert_one_node_job(r.stdout, 2)


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_manual_launch_from_two_terminals_seconds_apart(scheme, tmp_path):
    # rank 1 starts first and waits (tcp://: for rank 0's port, within its own deadline;
    # file://: in the file rank 1 created); rank 0 comes seconds later, as from another
    # terminal. The gap is the scenario, not a synchronisation: any gap below --timeout joins.
    # (each a process of its own, forked: as `python 01_init_methods.py ...` from a terminal)
    init = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/rdzv"
    args = ["--init-method", init, "--world-size", "2", "--timeout", "60"]
    rank1 = Watched(SCRIPT, *args, "--rank", 1, launcher="forked", timeout=90)
    time.sleep(2)
    rank0 = Watched(SCRIPT, *args, "--rank", 0, launcher="forked", timeout=90)
    rank0, rank1 = rank0.finish().ok(), rank1.finish().ok()
    assert_one_node_job(rank0.stdout, 2, scheme)
    assert rank1.stdout == ""  # rank 0 alone tells the story
    if scheme == "file":  # removed after the final barrier, so the next job finds no leftover
        assert not (tmp_path / "rdzv").exists()


def leftover_rendezvous_file(path) -> None:
    """What a killed job leaves: two ranks joined over file://PATH, then died without
    destroying the group (so the FileStore never deleted its file)."""
    code = (
        "import os, sys, datetime, torch.distributed as dist; "
        f"dist.init_process_group('gloo', init_method='file://{path}', rank=int(sys.argv[1]), "
        "world_size=2, timeout=datetime.timedelta(seconds=30)); dist.barrier(); os._exit(0)"
    )
    for r in run_many([[PYTHON, "-c", code, str(rank)] for rank in (0, 1)], timeout=60):
        r.ok()
    assert path.stat().st_size > 0


def test_a_killed_jobs_rendezvous_file_is_refused_at_start_by_every_rank(tmp_path):
    # Every rank of a 2-process job opened it (its "refcount/" record says 2), so no rank of
    # a new 2-process job can be among them: both refuse at once, naming the file. (Before,
    # a race decided: the job joined, or each rank named the file at --timeout.)
    leftover_rendezvous_file(tmp_path / "rdzv")
    r = forked(
        SCRIPT, "--init-method", f"file://{tmp_path}/rdzv", "--timeout", "30", nproc=2, timeout=60
    ).failed()
    lines = sorted(line for line in r.stderr.splitlines() if line.startswith("[rank "))
    assert len(lines) == 2, r
    assert lines == [
        f"[rank {rank}] error: {tmp_path}/rdzv is left by an earlier job (opened by 2 "
        f"process(es)): delete it or use a fresh path"
        for rank in (0, 1)
    ], r
    assert r.seconds < 15, r  # at start, not at --timeout


def test_a_file_of_a_world_of_one_is_refused_at_start(tmp_path):
    # no other rank of a one-process job could have written it, whatever it holds
    stale = tmp_path / "rdzv"
    stale.write_bytes(b"left by a job that was killed")
    args = ["--init-method", f"file://{stale}", "--rank", "0", "--world-size", "1"]
    r = forked(SCRIPT, *args, "--timeout", "60", timeout=30).failed()
    assert r.stderr.strip().splitlines() == [
        f"[rank 0] error: {stale} is left by an earlier job (opened by 0 process(es)): delete it "
        f"or use a fresh path"
    ], r


def test_a_live_rank_0s_file_that_looks_old_is_joined(tmp_path):
    # Clocks differ between machines (an NFS client stamping its own time): rank 0 is alive
    # and waiting, but its file's timestamp is an hour old. Staleness is not read from the
    # clock: one of two processes has opened the file, so rank 1 joins.
    rdzv = tmp_path / "rdzv"
    args = ["--init-method", f"file://{rdzv}", "--world-size", "2", "--timeout", "60"]
    rank0 = Watched(SCRIPT, *args, "--rank", "0", launcher="forked", timeout=90)
    deadline = time.monotonic() + 60
    while b"refcount/" not in (rdzv.read_bytes() if rdzv.exists() else b""):  # rank 0 opened it
        assert time.monotonic() < deadline and rank0.proc.poll() is None, "rank 0 wrote no file"
        time.sleep(0.05)  # polling a condition, with a deadline
    hour_ago = time.time() - 3600
    os.utime(rdzv, (hour_ago, hour_ago))
    rank1 = forked(SCRIPT, *args, "--rank", "1", timeout=90).ok()
    assert_one_node_job(rank0.finish().ok().stdout, 2, "file")
    assert rank1.stdout == ""


def test_manual_launch_as_two_nodes_states_local_ranks():
    # four processes started by hand as if on two machines of two: --local-rank picks the
    # GPU on a real node, and the node column follows from rank, local rank and node size
    # (each a process of its own, forked: as `python 01_init_methods.py ...` would be)
    init = f"tcp://127.0.0.1:{free_port()}"
    args = ["--init-method", init, "--world-size", "4", "--local-world-size", "2"]
    jobs = [
        Watched(
            SCRIPT, *args, "--rank", r, "--local-rank", r % 2, "--timeout", 60, launcher="forked"
        )
        for r in range(4)
    ]
    runs = [job.finish().ok() for job in jobs]
    rows = table(runs[0].stdout)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in rows] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert (
        runs[0].stdout.strip().splitlines()[-1]
        == f"verified: 4 rank(s) joined via tcp://; {expected_summary(4)}"
    )
    assert [r.stdout for r in runs[1:]] == ["", "", ""]  # rank 0 alone tells the story


def test_two_torchrun_agents_form_a_two_node_job():
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "two-node-test",
        str(REPO / SCRIPT),
        "--timeout",
        "60",
    ]
    a, b = run_many([agent, agent], timeout=120)
    a.ok(), b.ok()
    out = a.stdout + b.stdout
    rows = table(out)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    # rank = node rank * processes per node + local rank, on both nodes
    assert [(r["node_rank"], r["local_rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (
        out.strip().splitlines()[-1]
        == f"verified: 4 rank(s) joined via env://; {expected_summary(4)}"
    )


# --- bad input: a short message and a non-zero exit, never a hang ----------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("spawn", [[], ["--spawn", "2"]])
def test_nccl_without_cuda_is_a_clear_error(spawn, capsys):
    # refused while parsing, before anything starts (--spawn: before any child)
    with pytest.raises(SystemExit) as exit_:
        load_script(SCRIPT).parse_args(["--backend", "nccl", *spawn])
    assert exit_.value.code == 2
    assert (
        "--backend nccl needs a CUDA GPU and torch sees none; use --backend gloo"
        in capsys.readouterr().err
    )


# forked (launch.forked): one process, as `python 01_init_methods.py ...` would run it
def test_missing_ranks_fail_after_timeout_saying_how_many_joined(waiting):
    future, init = waiting["missing"]
    r = future.result().failed()
    # torch's own words after ours: "Timed out after ... waiting for clients. 1/3 clients joined."
    # (told apart from other failures by the time it came, not by its words)
    line = f"[rank 0] error: not all of 3 ranks joined within 1s ({init}): "
    assert r.stderr.startswith(line) and "1/3 clients joined" in r.stderr, r
    assert len(r.stderr.strip().splitlines()) == 1, r


def test_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--init-method", f"tcp://127.0.0.1:{port}", "--rank", "0", "--world-size", "2"]
        r = forked(SCRIPT, *args, "--timeout", "5", timeout=60).failed()
    assert f"[rank 0] error: cannot join the process group at tcp://127.0.0.1:{port}: " in r.stderr
    assert "Traceback" not in r.stderr


def test_an_ipv6_address_in_brackets_works_with_tcp():
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as probe:
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    # two processes started by hand (forked), as the README's manual launch
    args = ["--init-method", f"tcp://[::1]:{port}", "--world-size", "2", "--timeout", "60"]
    jobs = [Watched(SCRIPT, *args, "--rank", r, launcher="forked") for r in (0, 1)]
    r = jobs[0].finish().ok()
    assert jobs[1].finish().ok().stdout == ""
    assert_one_node_job(r.stdout, 2, "tcp")


MANUAL = ["--init-method", "tcp://127.0.0.1:1"]
RANGE = "< 4294967296"  # number()'s upper bound: 2**32
INIT = "use env://, tcp://HOST:PORT or file:///PATH in a folder every process sees"
FIT = "needs rank < world size, local rank <= rank, local rank < local world size <= world size"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--init-method", "udp://127.0.0.1:1"], f"{INIT}: udp://127.0.0.1:1"),
        (["--init-method", "tcp://127.0.0.1"], f"{INIT}: tcp://127.0.0.1"),
        (["--init-method", "tcp://[::1]"], f"{INIT}: tcp://[::1]"),
        (
            [*MANUAL, "--rank", "-1", "--world-size", "2"],
            f"--rank: must be >= 0 and {RANGE}, got -1",
        ),
        (
            [*MANUAL, "--rank", "2", "--world-size", "2"],
            f"--rank 2, --world-size 2, --local-rank 2, --local-world-size 2: {FIT}",
        ),
        ([*MANUAL, "--rank", "0"], "--rank and --world-size go together"),
        (["--spawn", "-1"], f"--spawn: must be >= 1 and {RANGE}, got -1"),
        (["--spawn", "0"], f"--spawn: must be >= 1 and {RANGE}, got 0"),
        (
            ["--init-method", "file:///no/such/folder/rdzv", "--rank", "0", "--world-size", "2"],
            f"{INIT}: file:///no/such/folder/rdzv",
        ),
        (
            [*MANUAL, "--rank", "1", "--world-size", "4", "--local-rank", "2"]
            + ["--local-world-size", "2"],
            f"--rank 1, --world-size 4, --local-rank 2, --local-world-size 2: {FIT}",
        ),
        (["--timeout", "-3"], f"--timeout: must be >= 0.1 and {RANGE}, got -3"),
        (["--timeout", "1e11"], f"--timeout: must be >= 0.1 and {RANGE}, got 1e11"),
        (["--timeout", "inf"], f"--timeout: must be >= 0.1 and {RANGE}, got inf"),
        (["--timeout", "nan"], f"--timeout: must be >= 0.1 and {RANGE}, got nan"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script(SCRIPT).parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_spawn_under_a_launcher_is_ignored():
    # forked with 2 processes, the launcher's variables set as torchrun sets them: each
    # process runs as the rank it was given, and --spawn 3 starts nothing
    r = forked(SCRIPT, "--spawn", "3", nproc=2, timeout=60).ok()
    assert_one_node_job(r.stdout, 2)


@pytest.mark.parametrize(
    "variables",
    [
        dict(RANK="0", WORLD_SIZE="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="0"),
        dict(RANK="5", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"),
        dict(RANK="-1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"),
        dict(RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),  # LOCAL_RANK not set: -1
    ],
)
def test_bad_launcher_variables_are_one_line_naming_them(variables):
    # forked with one process and no launcher of its own: the variables are the test's
    env = {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = forked(SCRIPT, "--timeout", "5", env=env, timeout=30)
    assert r.returncode == 1, r
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    values = ", ".join(f"{k} {variables.get(k, -1)}" for k in names)
    assert r.stderr.strip().splitlines() == [
        f"[rank {variables['RANK']}] error: the launcher's variables are invalid: {values} "
        "(-1: not set)"
    ], r


def test_a_launcher_variable_that_is_not_a_number_is_a_valueerror():
    # RANK=abc: int() refuses it, with its traceback (a one-line message for it left the
    # shared block in session 24: NOTES.md, "Rare traps")
    variables = dict(RANK="abc", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    env = {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = forked(SCRIPT, "--timeout", "5", env=env, timeout=30)
    assert r.returncode == 1, r
    line = "[rank abc] error: ValueError: invalid literal for int() with base 10: 'abc'"
    assert r.stderr.strip().splitlines()[-1] == line, r


@pytest.fixture(scope="module")
def waiting():
    """The launches of the tests below that only wait (for peers that never come, a port that
    never answers, a name that never resolves), started together, each in a thread of its
    own: a test's name -> (its future Run, the port or address it was given). Together they
    take as long as the longest; each keeps its deadline, and each test reads its own."""
    init = f"tcp://127.0.0.1:{free_port()}"
    never = free_port()
    squatter = socket.create_server(("127.0.0.1", 0))  # accepts, and never answers
    port = squatter.getsockname()[1]
    launches = {
        "missing": (
            ["--init-method", init, "--rank", "0", "--world-size", "3", "--timeout", "1"],
            None,
            init,
        ),
        "never": (["--timeout", "1"], alone(1, "127.0.0.1", never), never),
        "squatter": (["--timeout", "1"], alone(1, "127.0.0.1", port), port),
        **{
            f"unresolvable {rank}": (
                ["--timeout", "2"],
                alone(rank, "no-such-host.invalid", 29500),
                "no-such-host.invalid",
            )
            for rank in (0, 1)
        },
    }
    with squatter, concurrent.futures.ThreadPoolExecutor(len(launches)) as pool:
        yield {
            name: (pool.submit(forked, SCRIPT, *args, env=env, timeout=60), where)
            for name, (args, env, where) in launches.items()
        }


def alone(rank: int, address: str, port: int) -> dict:
    """The variables a launcher gives rank `rank` of 2, whose peer never comes."""
    return dict(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR=address, MASTER_PORT=str(port),
    )  # fmt: skip


def test_a_rank_whose_rank_0_never_comes_ends_within_its_timeout(waiting):
    # torch's own TCPStore client times out, waits a random delay and tries once more: up to
    # twice --timeout (its warning says "retrying (try=0, timeout=..., delay=...)"). The
    # shared setup() ends the process at --timeout + 2 s, if torch has not given up first.
    future, port = waiting["never"]
    r = future.result()
    assert r.returncode == 1, r
    assert r.seconds < 1 + 2 + 3, r  # (torch 2.4.1's client gave up after 2 s)
    [line] = ours(r, 1)
    where = re.escape(f"env:// at 127.0.0.1:{port}")
    # ours at the deadline, or torch's own words if it gave up first
    assert re.fullmatch(
        rf"\[rank 1\] error: cannot join the process group at {where}: (not all of 2 ranks "
        rf"joined within 1s|The client socket has timed out after 1(000ms|s) while trying to "
        rf"connect to \(127\.0\.0\.1, {port}\)\.)",
        line,
    ), r


def test_a_rank_whose_master_port_another_program_holds_ends_within_its_timeout(waiting):
    # A port held by another program (a web server, another job) that accepts and never
    # answers: torch's store client waits in recv with no deadline (300 s seen on --timeout
    # 15). The deadline ends it, with one line.
    future, port = waiting["squatter"]
    r = future.result()
    assert r.returncode == 1, r
    assert 1 + 2 <= r.seconds < 1 + 2 + 3, r
    assert r.stderr.strip().splitlines() == [
        f"[rank 1] error: cannot join the process group at env:// at 127.0.0.1:{port}: "
        "not all of 2 ranks joined within 1s"
    ], r


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unresolvable_master_addr_is_named_within_its_timeout(rank, waiting):
    future, _ = waiting[f"unresolvable {rank}"]
    r = future.result()
    assert r.returncode == 1, r
    assert r.seconds < 2 + 2 + 3, r
    [line] = ours(r, rank)
    assert "env:// at no-such-host.invalid:29500" in line, r  # where it was told to meet


def ours(r, rank: int) -> list[str]:
    """The rank's own lines. torch's store logs its retries with a C++ stack trace, from the
    thread still joining, and may do so after the rank's line (the process ends right
    after it), so the rank's line is not always the last."""
    return [line for line in r.stderr.splitlines() if line.startswith(f"[rank {rank}] ")]


@pytest.mark.parametrize(
    "gpus, rank, world, device", [(1, 3, 4, "cuda:0"), (2, 1, 2, "cuda:1"), (4, 3, 4, "cuda:3")]
)
def test_each_rank_binds_its_gpu_or_the_one_it_was_given(gpus, rank, world, device, monkeypatch):
    # srun --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: each process sees one GPU,
    # its own, as cuda:0; else local rank r takes cuda:r. Faked counts, in this process:
    # bind_device makes no CUDA call but set_device.
    bound = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as srun sets it for each task
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert str(load_script(SCRIPT).bind_device(rank, world)) == device
    assert [str(d) for d in bound] == [device]


@pytest.mark.parametrize("gpus, world, visible", [(2, 4, "0,1"), (1, 2, None)])
def test_more_processes_than_gpus_is_refused(gpus, world, visible, monkeypatch):
    # (1, 2, None): torchrun --nproc_per_node 2 on a one-GPU workstation; both ranks would
    # bind cuda:0 and NCCL would fail at init ("Duplicate GPU detected")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    script = load_script(SCRIPT)
    with pytest.raises(script.SetupError) as error:
        script.bind_device(0, world)
    assert str(error.value) == f"{world} processes here, {gpus} GPU(s): NCCL needs a GPU each"


@pytest.mark.parametrize(
    "mine, parents, local_world, threads",
    [
        (range(16), range(16), 4, 4),  # torchrun, mp.spawn: the node's cores, shared
        (range(2), range(2), 4, 1),  # more processes than cores: one thread each
        (range(8, 16), range(64), 4, 2),  # its own 8 cores, shared by the node's 4 ranks
        (range(64), range(8, 16), 4, 16),  # wider than its parent: shared all the same
    ],
)
def test_each_process_gets_its_share_of_the_cores(mine, parents, local_world, threads, monkeypatch):
    # the affinity is faked (this machine has few cores), the decision is the script's
    set_threads = []
    affinity = {0: set(mine), os.getppid(): set(parents)}
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    monkeypatch.setattr(os, "sched_getaffinity", affinity.__getitem__)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too
    assert str(load_script(SCRIPT).bind_device(1, local_world)) == "cpu"
    assert set_threads == [threads]


def test_bad_argument_exits_2_from_the_command_line():
    r = run(SCRIPT, "--init-method", "tcp://127.0.0.1:1", "--rank", "2", "--world-size", "2")
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines()[-1] == (
        f"01_init_methods.py: error: --rank 2, --world-size 2, --local-rank 2, "
        f"--local-world-size 2: {FIT}"
    )


def test_a_manual_rank_sits_on_one_machine_unless_told_its_place_there():
    # by hand on two machines of 2 processes: rank 2 without --local-rank/--local-world-size
    # is local rank 2 of 4 on one machine (the table check below catches that on two); with
    # them, local rank 0 of the second machine's 2
    manual = ["--init-method", "tcp://127.0.0.1:1", "--rank", "2", "--world-size", "4"]
    args = load_script(SCRIPT).parse_args(manual)
    assert (args.local_rank, args.local_world_size) == (2, 4)
    args = load_script(SCRIPT).parse_args([*manual, "--local-rank", "0", "--local-world-size", "2"])
    assert (args.local_rank, args.local_world_size) == (0, 2)


def test_a_node_rank_on_two_machines_fails_the_table_check():
    # two machines, 2 processes each, launched by hand without --local-rank: ranks 2 and 3
    # default to local ranks 2 and 3 of a 4-process node, node 0, on the second machine.
    # The rows are the gathered table as such a launch would give it.
    script = load_script(SCRIPT)
    rows = [
        dict(rank=r, local_rank=r, node_rank=0, world_size=4, host=host)
        for r, host in enumerate(["gpu-a", "gpu-a", "gpu-b", "gpu-b"])
    ]
    with pytest.raises(script.CheckFailed) as failed:
        script.verify_table(rows, 4)
    assert str(failed.value) == (
        "nodes: a node rank on several machines, in [(0, 'gpu-a'), (0, 'gpu-b')]: by hand on "
        "several machines, give each process --local-rank and --local-world-size"
    )
    # with them, rank 2 is local 0 of node 1 and rank 3 local 1: the table holds
    for row, local in zip(rows[2:], (0, 1)):
        row.update(local_rank=local, node_rank=1)
    script.verify_table(rows, 4)


@pytest.mark.parametrize("init", ["env", "tcp"])
def test_ctrl_c_while_a_rank_waits_for_its_peers_ends_it_at_once(init):
    # torch's store waits in C++, where Python's signal handlers cannot run: Ctrl-C took
    # effect only at --timeout. The rank joins in a thread and waits for it, ready for a
    # signal. The peer here is a program that accepts the connection and never answers: once
    # it has accepted, the rank is waiting inside init_process_group.
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        squatter.settimeout(60)
        port = squatter.getsockname()[1]
        if init == "env":
            job = Watched(SCRIPT, "--timeout", 60, env=alone(1, "127.0.0.1", port))
        else:
            manual = ["--rank", "1", "--world-size", "2", "--timeout", 60]
            job = Watched(SCRIPT, "--init-method", f"tcp://127.0.0.1:{port}", *manual)
        connection, _ = squatter.accept()
        with connection:
            signalled = time.monotonic()
            os.kill(job.proc.pid, signal.SIGINT)
            r = job.finish()
    assert r.returncode == 130, r
    assert time.monotonic() - signalled < 10, r  # not --timeout (60 s)
    assert [line for line in r.stderr.splitlines() if line.startswith("[rank")] == [
        "[rank 1] stopped by SIGINT"
    ], r
