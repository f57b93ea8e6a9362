"""The process supervisor with real processes: restarts, status, and a clean stop."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from specpipe.ops.supervisor import ProcessSpec, Supervisor
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def sleeper_with_grandchild(pidfile: Path) -> list[str]:
    code = textwrap.dedent(f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        open({str(pidfile)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
    """)
    return [PY, "-c", code]


def read_pids(pidfile: Path) -> list[int]:
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, f"pids in {pidfile}")
    return [int(p) for p in pidfile.read_text().split()]


def test_a_crashing_child_is_restarted_with_growing_backoff_and_others_keep_running(tmp_path):
    lines: list[str] = []
    sup = Supervisor(
        [
            ProcessSpec("sleeper", [PY, "-c", "import time; time.sleep(300)"]),
            ProcessSpec("crasher", [PY, "-c", "import sys; sys.exit(3)"]),
        ],
        backoff_initial_s=0.1,
        backoff_max_s=0.4,
        out=lines.append,
    )
    sup.start()
    try:
        sleeper_pid = sup.children["sleeper"].process.pid
        wait_until(
            lambda: (sup.poll(), sup.children["crasher"].restarts >= 3)[1],
            10,
            "the crasher's third restart",
        )
        crasher = sup.children["crasher"]
        assert crasher.last_exit == 3
        assert crasher.backoff_s == 0.4  # doubled from 0.1 and capped
        assert sup.children["sleeper"].process.pid == sleeper_pid
        assert sup.children["sleeper"].restarts == 0
        assert any(line.startswith("crasher: exited with 3; restarting in") for line in lines)
        status = sup.status_lines()
        assert status[0].startswith("sleeper") and f"pid {sleeper_pid}" in status[0]
        assert status[1].startswith("crasher") and "restarts" in status[1]
    finally:
        sup.stop()
    assert not alive(sleeper_pid)


def test_stop_leaves_no_process_behind_even_grandchildren(tmp_path):
    sup = Supervisor([ProcessSpec("tree", sleeper_with_grandchild(tmp_path / "pids"))])
    sup.start()
    pids = read_pids(tmp_path / "pids")
    assert all(alive(p) for p in pids)
    sup.stop()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the child and grandchild to exit")
    assert sup.children["tree"].process is None


def test_a_child_that_ignores_sigterm_is_killed(tmp_path):
    ready = tmp_path / "ready"
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(300)"
    )
    sup = Supervisor([ProcessSpec("stubborn", [PY, "-c", code])])
    sup.start()
    pid = sup.children["stubborn"].process.pid
    wait_until(ready.exists, 10, "the child to ignore SIGTERM")
    started = time.monotonic()
    sup.stop(timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert not alive(pid)
    assert sup.children["stubborn"].last_exit == -signal.SIGKILL


def run_supervisor(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    script = textwrap.dedent(f"""
        from specpipe.ops.supervisor import ProcessSpec, Supervisor
        specs = [ProcessSpec("a", {sleeper_with_grandchild(tmp_path / "a")!r}),
                 ProcessSpec("b", {sleeper_with_grandchild(tmp_path / "b")!r})]
        Supervisor(specs).run()
        print("stopped", flush=True)
    """)
    proc = subprocess.Popen([PY, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return proc, read_pids(tmp_path / "a") + read_pids(tmp_path / "b")


def test_sigterm_stops_everything(tmp_path):
    proc, pids = run_supervisor(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and out.splitlines()[-1] == "stopped"
    assert out.splitlines()[0].startswith("a ") and "running" in out.splitlines()[0]
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every child and grandchild to exit")


def test_ctrl_c_stops_everything(tmp_path):
    proc, pids = run_supervisor(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "stopped" in out
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every child and grandchild to exit")


def test_children_die_with_a_killed_supervisor(tmp_path):
    proc, pids = run_supervisor(tmp_path)
    leaders = [pids[0], pids[2]]
    proc.kill()
    proc.wait()
    wait_until(lambda: not any(alive(p) for p in leaders), 10, "the children to exit")
    for p in pids:  # the grandchildren are not covered by that; clean up what is left
        if alive(p):
            os.kill(p, signal.SIGKILL)


def test_terminate_all_kills_what_ignores_sigterm():
    import subprocess
    import sys
    import time

    from specpipe.ops.supervisor import terminate_all

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stubborn.stdout.readline().strip() == "ready"
    started = time.monotonic()
    terminate_all([polite, stubborn], timeout_s=1.0)
    assert polite.returncode == -15 and stubborn.returncode == -9
    assert time.monotonic() - started < 10
    stubborn.stdout.close()


def stamping(path: Path, delay_s: float = 0.0) -> list[str]:
    """A child that waits `delay_s`, writes its start time to `path`, and on SIGTERM appends
    the time it was told to stop."""
    code = textwrap.dedent(f"""
        import signal, sys, time
        def stop(*_):
            open({str(path)!r}, "a").write(f" {{time.monotonic()}}")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep({delay_s})
        open({str(path)!r}, "w").write(str(time.monotonic()))
        time.sleep(300)
    """)
    return [PY, "-c", code]


def test_a_child_others_need_starts_first_and_stops_last(tmp_path):
    service, user = tmp_path / "service", tmp_path / "user"

    def service_ready() -> bool:
        return service.exists() and bool(service.read_text())

    sup = Supervisor(
        [
            ProcessSpec(
                "service", stamping(service, delay_s=0.5), ready=service_ready, stop_last=True
            ),
            ProcessSpec("user", stamping(user)),
        ],
        out=lambda line: None,
    )
    sup.start()
    wait_until(lambda: user.exists() and user.read_text(), 10, "the user child to start")
    sup.stop()
    service_started, service_stopped = map(float, service.read_text().split())
    user_started, user_stopped = map(float, user.read_text().split())
    assert service_started < user_started  # the user was started once the service was ready
    assert user_stopped < service_stopped  # and told to stop before the service


def test_it_says_which_pid_each_child_has_as_they_start_die_and_stop():
    records: list[dict[str, int]] = []
    sleep = [PY, "-c", "import time; time.sleep(300)"]
    sup = Supervisor(
        [ProcessSpec("a", sleep), ProcessSpec("b", sleep)],
        backoff_initial_s=0.1,
        out=lambda line: None,
        on_change=records.append,
    )
    sup.start()
    try:
        first = sup.pids()
        assert records[-1] == first and set(first) == {"a", "b"}
        assert first["a"] == sup.children["a"].process.pid
        os.kill(first["b"], signal.SIGKILL)
        wait_until(
            lambda: (sup.poll(), sup.pids().get("b", first["b"]) != first["b"])[1],
            10,
            "b to be started again",
        )
        assert {"a": first["a"]} in records  # b was off the record while it was down
        assert records[-1] == {"a": first["a"], "b": sup.children["b"].process.pid}
    finally:
        sup.stop()
    assert records[-1] == {} == sup.pids()
