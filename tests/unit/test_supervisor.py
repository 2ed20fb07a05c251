"""The supervisor on its own: it replaces a worker that exits or hangs (killing the hung
one by its pid), gives every replacement the failed rank's identity, leaves alone a worker
whose training finished (and reports, without replacing it, one that fails after its
training ended), and stops with a non-zero code once ``max_restarts`` is used up.
Workers here are tiny Python commands; ``python -m lightning_moe_ckpt.supervise`` runs
them from a script file."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.cli import main as supervise
from lightning_moe_ckpt.failures.supervisor import Supervisor
from tests.conftest import REPO
from tests.forked import PRELOAD, run_python

# A worker: rank 1 fails in generation 0 as told by argv[1] (exit, or hang after one
# heartbeat); everyone else, and any replacement, finishes at once.
WORKER = textwrap.dedent("""
    import gc, os, sys, time
    gc.disable()  # nothing to collect in a worker this short: it starts and exits faster
    from datetime import timedelta
    from torch.distributed import TCPStore
    from lightning_moe_ckpt.failures.rendezvous import await_assignment
    from lightning_moe_ckpt.failures.protocol import ControlChannel, finished_key, heartbeat_key
    gc.freeze()
    if not await_assignment():  # a warm spare the job did not need
        sys.exit(0)
    host, port = os.environ["MOE_STORE"].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    channel = ControlChannel(store, os.environ["MOE_JOB_SECRET"])
    rank = int(os.environ["RANK"])
    store.add(heartbeat_key(rank, os.getpid()), 1)
    print(f"worker rank={rank} replaces={os.environ.get('MOE_REPLACES')} "
          f"parent={os.getppid()}", flush=True)
    if sys.argv[1] == "node_hang" and "MOE_REPLACES" not in os.environ:
        # node 1 stalls: rank 3 at once, rank 2 two seconds later (it beats until then)
        if rank in (2, 3):
            for _ in range(2 if rank == 2 else 0):
                time.sleep(1.0)
                store.add(heartbeat_key(rank, os.getpid()), 1)
            time.sleep(600)
    elif sys.argv[1].startswith("node") and "MOE_REPLACES" not in os.environ:
        # node 1 (ranks 2, 3) is lost; its processes are seen to die one by one
        if rank == 2 or (rank == 3 and sys.argv[1] == "node"):
            time.sleep(0.3 * (rank - 2))
            sys.exit(3)
    elif rank == 1 and "MOE_REPLACES" not in os.environ:
        if sys.argv[1] == "exit":
            sys.exit(3)
        if sys.argv[1] == "finished":  # its training is over; it lingers, then leaves
            channel.set(finished_key(rank, os.getpid()), "1")
            time.sleep(8)
            sys.exit(0)
        if sys.argv[1] == "abort_after_training":  # dies at exit, its training over
            channel.set(finished_key(rank, os.getpid()), "1")
            os.abort()
        if sys.argv[1] == "config_error":  # a set-up error, raised as a library raises it
            from lightning_moe_ckpt.errors import ConfigError
            from lightning_moe_ckpt.failures.rendezvous import JobStore
            JobStore.from_env(30.0)
            raise ConfigError("parallel.ep=3 is not supported here (a test's set-up error)")
        time.sleep(600)  # hang: no more heartbeats
""")


@pytest.fixture(scope="module")
def worker_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = tmp_path_factory.mktemp("worker") / "worker.py"
    script.write_text(WORKER)
    return script


def _supervisor(script: Path, mode: str, max_restarts: int = 3, timeout_s: float = 30.0,
                spares: int = 0) -> Supervisor:
    """Workers forked from the tests' fork server (their imports done: it spares each
    worker seconds of start-up); ``test_exited_worker_is_replaced_with_its_rank`` starts
    them as fresh interpreters."""
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    return Supervisor([sys.executable, str(script), mode], 3, timeout_s, max_restarts,
                      spares, env=env, fork_workers=True, preload=(PRELOAD,))


def test_exited_worker_is_replaced_with_its_rank(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``python -m lightning_moe_ckpt.supervise`` with a script file."""
    script, status = tmp_path / "worker.py", tmp_path / "workers.json"
    script.write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    assert supervise(["--workers", "3", "--status", str(status), str(script), "exit"]) == 0
    view = json.loads(status.read_text())
    (replacement,) = view["replacements"]
    assert (replacement["rank"], replacement["generation"], replacement["cause"]) == (
        1, 1, "exit 3")
    assert replacement["new_pid"] != replacement["dead_pid"]
    pids = view["worker_pids"]
    assert pids["1"] == [replacement["dead_pid"], replacement["new_pid"]]
    assert len(pids["0"]) == len(pids["2"]) == 1  # survivors untouched


def test_forked_workers_are_replaced_as_fresh_ones_are(tmp_path: Path) -> None:
    """``--fork-workers``: every worker, the replacement included, is forked from one fork
    server (their parent), not started by the supervisor, and the job goes as above. The
    supervisor runs in a process of its own: the fork server it starts is its own."""
    script, status = tmp_path / "worker.py", tmp_path / "workers.json"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = run_python(["-m", "lightning_moe_ckpt.supervise", "--fork-workers", "--workers",
                       "3", "--status", str(status), str(script), "exit"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    view = json.loads(status.read_text())
    (replacement,) = view["replacements"]
    assert (replacement["rank"], replacement["cause"]) == (1, "exit 3")
    assert view["worker_pids"]["1"] == [replacement["dead_pid"], replacement["new_pid"]]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("worker ")]
    assert sorted(line[1] for line in lines) == ["rank=0", "rank=1", "rank=1", "rank=2"]
    (parent,) = {line[3] for line in lines}
    assert parent != f"parent={view['supervisor']}"


# A script run forked as python would run it: where it lives, its arguments, its rank.
AS_MAIN = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    print(sys.argv[1:], os.path.basename(sys.path[0]), rank_zero_only.rank, flush=True)
    atexit.register(lambda: print("atexit", file=sys.stderr, flush=True))
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread", file=sys.stderr,
                                                               flush=True))).start()
    if sys.argv[1] == "exit":
        sys.exit(3)
    raise RuntimeError("boom")
""")


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_forked_script_runs_and_leaves_as_python_would(tmp_path: Path, how: str) -> None:
    """Its directory first on ``sys.path``, ``sys.argv`` and Lightning's rank-zero rank from
    ``RANK``; at the end the traceback, then the threads joined, then ``atexit``."""
    script = tmp_path / "here" / "script.py"
    script.parent.mkdir()
    script.write_text(AS_MAIN)
    done = run_python([str(script), how], env={**os.environ, "RANK": "2"}, cwd=REPO)
    assert done.stdout.split("\n")[0] == f"['{how}'] here 2"
    assert done.returncode == (3 if how == "exit" else 1)
    end = [line for line in done.stderr.splitlines() if line in ("thread", "atexit")]
    assert end == ["thread", "atexit"], done.stderr
    if how == "raise":
        assert done.stderr.index("RuntimeError: boom") < done.stderr.index("thread")


# Forks a worker that sleeps, kills the fork server under it (its parent), then stops it
# as the supervisor stops its workers.
SERVER_LOST = textwrap.dedent("""
    import os, signal, sys, time
    from lightning_moe_ckpt.failures.forked_workers import WorkerForker
    from lightning_moe_ckpt.failures.supervisor import Supervisor
    if __name__ == "__main__" and sys.argv[1] == "sleep":
        time.sleep(120)
    elif __name__ == "__main__":  # (a worker imports this file as __mp_main__ first)
        worker = WorkerForker([sys.executable, sys.argv[0], "sleep"]).start(dict(os.environ))
        with open(f"/proc/{worker.pid}/stat") as stat:
            server = int(stat.read().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGKILL)
        time.sleep(1.0)
        try:
            worker.poll()
        except RuntimeError as error:
            print("error:", error, flush=True)
        os.kill(worker.pid, 0)  # still there: the server's report was not the worker's exit
        Supervisor._stop({0: worker})  # kills it, and returns once it ended
        try:  # ended: a zombie until init reaps it
            with open(f"/proc/{worker.pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        print("after stop:", state, worker.poll() is not None, flush=True)  # no error: ended
""")


def test_a_lost_fork_server_is_an_error_not_every_worker_failed(tmp_path: Path) -> None:
    script = tmp_path / "server_lost.py"
    script.write_text(SERVER_LOST)
    done = run_python([str(script), "start"], env=dict(os.environ), cwd=REPO, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("error: the fork server that started worker pid ")
    assert lines[1] in ("after stop: Z True", "after stop: gone True"), done.stdout


# Forks two workers, one after the other, into another directory, with another
# OMP_NUM_THREADS, into a log file (both named relative to the parent's directory); each
# draws from NumPy's global generator.
FORKED_IN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import numpy
    import torch
    from lightning_moe_ckpt.failures.forked_workers import WorkerForker
    if __name__ == "__main__" and sys.argv[1] == "child":
        draw = numpy.random.randint(2**62)
        print("child", os.getcwd(), torch.get_num_threads(), draw, flush=True)
        print("to stderr", file=sys.stderr, flush=True)
    elif __name__ == "__main__":
        here = Path(sys.argv[2])
        forker = WorkerForker([sys.executable, sys.argv[0], "child"], preload=("numpy",))
        os.chdir(here.parent)  # paths relative to this process, not to the worker's cwd
        for _ in range(2):
            worker = forker.start({**os.environ, "OMP_NUM_THREADS": "1"},
                                  cwd=Path(here.name), output=Path(here.name) / "log")
            print("exit", worker.wait(), flush=True)
""")


def test_a_forked_worker_gets_its_directory_threads_log_and_generator(tmp_path: Path) -> None:
    """The fork server imported torch with two threads (its environment's) and NumPy; each
    worker runs with the one thread its own environment names, in its directory, both
    streams in its log (relative paths taken from the parent's directory), and draws from
    a NumPy generator of its own (the server's state, copied into both, would make them
    draw alike)."""
    script = tmp_path / "forked_in.py"
    script.write_text(FORKED_IN)
    here = tmp_path / "here"
    here.mkdir()
    done = run_python([str(script), "start", str(here)],
                      env={**os.environ, "OMP_NUM_THREADS": "2"}, cwd=REPO, timeout_s=120)
    assert done.returncode == 0 and done.stdout == "exit 0\nexit 0\n", done.stderr[-3000:]
    lines = (here / "log").read_text().splitlines()
    assert [line.rsplit(" ", 1)[0] for line in lines[0::2]] == [f"child {here} 1"] * 2, lines
    assert lines[1::2] == ["to stderr"] * 2, lines
    assert lines[0] != lines[2], lines


def test_a_rank_the_test_harness_forks_runs_with_the_threads_its_environment_names(
        tmp_path: Path) -> None:
    """As a fresh interpreter would: the fork server imported torch with the threads of the
    environment it started in, and a golden run and a supervised one of the same job must
    run the same kernels to stay bitwise equal (five is no machine's default here)."""
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    done = run_python([str(script)], env={**os.environ, "OMP_NUM_THREADS": "5"}, cwd=REPO,
                      ranks=2, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["5", "5"]


def test_a_command_forked_workers_cannot_run_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"fork_workers runs .* got the command .*'-c'"):
        Supervisor([sys.executable, "-c", WORKER], 3, fork_workers=True)


def test_the_command_line_names_a_bad_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        supervise(["--workers", "0", "train.py"])
    assert "--workers=0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        supervise(["--workers", "2"])
    assert "name the training script" in capsys.readouterr().err


def test_a_worker_whose_training_finished_is_not_taken_for_hung(worker_script: Path) -> None:
    # It lingers past the timeout.
    supervisor = _supervisor(worker_script, "finished", timeout_s=3.0)
    assert supervisor.run() == 0
    assert supervisor.replacements == []


def test_a_worker_failing_after_its_training_ended_fails_the_job_unreplaced(
        worker_script: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No generation can form once ranks finished: the failure is reported, not
    replaced (a replacement would wait for peers that are gone)."""
    supervisor = _supervisor(worker_script, "abort_after_training")
    assert supervisor.run() == 1
    assert supervisor.replacements == []
    assert len(supervisor.pids[1]) == 1  # no process was started for rank 1
    err = caplog.text  # logged by the library's logger
    assert f"rank 1 (pid {supervisor.pids[1][0]}) failed after its training loop ended: " \
        f"exit {-signal.SIGABRT}; not replaced" in err
    assert "destroy_process_group()" in err


def test_a_warm_spare_takes_the_failed_rank_and_unused_spares_leave(worker_script: Path) -> None:
    supervisor = _supervisor(worker_script, "exit", spares=2)
    assert supervisor.run() == 0
    (replacement,) = supervisor.replacements
    assert replacement.warm_spare and replacement.rank == 1
    assert replacement.new_pid == supervisor.spare_pids[0]  # started with the job
    for pid in supervisor.spare_pids:  # the unused spare was told to leave, and did
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"spare {pid} is still alive")


def test_hung_worker_is_killed_after_the_timeout_and_replaced(worker_script: Path) -> None:
    supervisor = _supervisor(worker_script, "hang", timeout_s=5.0)
    assert supervisor.run() == 0
    (replacement,) = supervisor.replacements
    assert (replacement.rank, replacement.cause) == (1, "hang")
    assert 5.0 <= replacement.detected_s < 120.0
    try:  # the hung process is gone: killed by its pid
        os.kill(replacement.dead_pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"hung worker {replacement.dead_pid} is still alive")


def test_no_restart_left_stops_the_job(worker_script: Path) -> None:
    """With no replacement left the job ends with its documented code (started again, it
    resumes from its newest durable checkpoint)."""
    from lightning_moe_ckpt.failures.protocol import EXIT_NO_SPARE

    supervisor = _supervisor(worker_script, "exit", max_restarts=0)
    assert supervisor.run() == EXIT_NO_SPARE == 89
    assert supervisor.replacements == []


def test_a_configuration_error_stops_the_job_at_once_without_replacements(
        worker_script: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A set-up error would stop every replacement too: it is reported once, and the
    worker that raised it is not replaced."""
    from lightning_moe_ckpt.failures.protocol import EXIT_CONFIG

    supervisor = _supervisor(worker_script, "config_error")
    assert supervisor.run() == EXIT_CONFIG == 88
    assert supervisor.replacements == []
    assert len(supervisor.pids[1]) == 1  # no process was started for rank 1
    assert "stopped on a configuration error" in caplog.text


def test_an_external_launcher_is_named() -> None:
    from lightning_moe_ckpt.failures.protocol import ENV_STORE
    from lightning_moe_ckpt.failures.supervisor import external_launcher

    assert external_launcher({}) is None
    assert external_launcher({"WORLD_SIZE": "1"}) is None
    assert external_launcher({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}).startswith(
        "torchrun")
    assert external_launcher({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}) == \
        "srun (SLURM_NTASKS=4)"
    assert external_launcher({"WORLD_SIZE": "2", "RANK": "1"}) == "a launcher (WORLD_SIZE=2)"
    assert external_launcher({"WORLD_SIZE": "2", ENV_STORE: "127.0.0.1:1"}) is None


def test_the_recipe_refuses_to_supervise_under_another_launcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every process would start a supervisor and a whole job of its own."""
    from omegaconf import OmegaConf

    from moe_recipes.settings import settings_from_config
    from moe_recipes.supervised import needs_supervisor

    settings = settings_from_config(OmegaConf.create(
        {"parallel": {"pp": 2, "microbatches": 2}, "recovery": {"supervise": True}}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"recovery\.supervise=True .* under torchrun"):
        needs_supervisor(settings)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("WORLD_SIZE")
    assert needs_supervisor(settings)


@pytest.mark.parametrize("mode", ["node", "node_partial"])
def test_a_spare_node_takes_over_a_node_whose_ranks_all_failed(worker_script: Path,
                                                                 mode: str) -> None:
    """Four ranks on two nodes of two, one spare node: node 1 lost (its two processes
    exiting 0.3 s apart) is taken over by the spare node, rank for rank; a single rank of
    it failing is replaced by a new process, the spare node left for a whole node."""
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    supervisor = Supervisor([sys.executable, str(worker_script), mode], 4, 30.0, 3,
                            env=env, fork_workers=True, preload=(PRELOAD,),
                            ranks_per_node=2, spare_nodes=1)
    assert supervisor.run() == 0
    (spare_node,) = supervisor.spare_node_pids
    replacements = sorted(supervisor.replacements, key=lambda r: r.rank)
    if mode == "node":
        assert [(r.rank, r.node, r.spare_node, r.warm_spare) for r in replacements] == [
            (2, 1, 0, True), (3, 1, 0, True)]
        assert [r.generation for r in replacements] == [1, 1]  # one failure, one generation
        assert [r.new_pid for r in replacements] == spare_node
    else:
        (replacement,) = replacements
        assert (replacement.rank, replacement.spare_node, replacement.warm_spare) == (
            2, None, False)
        assert replacement.new_pid not in spare_node
    assert len(supervisor.pids[0]) == len(supervisor.pids[1]) == 1  # node 0 untouched


def test_nodes_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="ranks_per_node=3 must be >= 1 and divide the world "
                                         "size 4"):
        Supervisor(["true"], 4, ranks_per_node=3)
    with pytest.raises(ValueError, match="spare_nodes=1 must be >= 0, and needs "
                                         "ranks_per_node"):
        Supervisor(["true"], 4, spare_nodes=1)


def test_a_hung_node_is_taken_over_whole_though_its_ranks_stalled_apart(
        worker_script: Path) -> None:
    """Node 1's ranks stop beating two seconds apart: when rank 3 is found hung, rank 2,
    still for all but a few seconds of the timeout, is taken as hung with it, so the
    spare node takes the whole node in one generation."""
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    supervisor = Supervisor([sys.executable, str(worker_script), "node_hang"], 4, 6.0, 3,
                            env=env, fork_workers=True, preload=(PRELOAD,),
                            ranks_per_node=2, spare_nodes=1)
    assert supervisor.run() == 0
    replacements = sorted(supervisor.replacements, key=lambda r: r.rank)
    assert [(r.rank, r.cause, r.spare_node, r.generation) for r in replacements] == [
        (2, "hang", 0, 1), (3, "hang", 0, 1)]
