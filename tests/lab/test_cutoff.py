"""A whole host cut off from the network (its link down: its stage and its Redis gone at once)
while a spare on another host serves its layers: the job re-routes within seconds and ends
with the tokens of an undisturbed run."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from models.db import make_session_factory
from models.runs import Run
from specpipe.ops.lab_hosts import Lab
from specpipe.ops.lab_network import PREFIX
from tests.lab.conftest import need_lab, run
from tests.lab.test_join import (
    ARGS,
    PROMPT,
    admit,
    join_argv,
    lab_env,
    latest_job,
    nodes,
    one_process_tokens,
)
from tests.waiting import wait_until


@pytest.mark.slow
def test_a_cut_off_host_with_a_spare_is_routed_around(tiny, tmp_path):
    need_lab()
    home = tmp_path / "lab"
    up = run(
        "lab",
        "up",
        "--hosts",
        "2",
        "--idle",
        "1",
        "--model",
        str(tiny),
        "--link-delay-ms",
        "2",
        "--port",
        "8002",
        "--home",
        str(home),
    )
    lab = Lab(home)
    lab.load()
    joined = None
    try:
        assert up.exit_code == 0, up.output
        bare = lab.hosts()[2]
        admit(lab, bare.name)
        joined = subprocess.Popen(
            join_argv(bare, tiny, "2:4"),
            env=lab.env(bare),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: any(n.host == bare.name for n in nodes(lab)), 60, "the spare")
        want = one_process_tokens(lab, tiny)
        out = {}
        thread = threading.Thread(
            target=lambda: out.update(
                result=run(
                    "generate", PROMPT, "--model", str(tiny), "--json", *ARGS, env=lab_env(lab)
                )
            )
        )
        thread.start()
        job = wait_until(
            lambda: (j := latest_job(lab)) and j.generated_tokens >= 10 and j.run_id and j,
            60,
            "10 tokens of the job",
        )
        with make_session_factory(lab.state["database_url"])() as session:
            tail = session.get(Run, job.run_id).topology.split(" -> ")[-1]
        assert tail in ("h1", "h2")
        before = job.generated_tokens
        link = f"{PREFIX}{lab.state['id']}v{tail[1:]}"
        subprocess.run(["ip", "link", "set", link, "down"], check=True)  # the host is cut off
        cut = time.monotonic()

        def next_round() -> bool:
            job = latest_job(lab)
            return job.generated_tokens > before + 1 or job.finished

        wait_until(next_round, 60, "the next round", interval_s=0.01)
        stall_s = time.monotonic() - cut
        thread.join(120)
        result = out["result"]
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tokens"] == want
        assert stall_s < 6.0, stall_s
    finally:
        lab.down()
        if joined is not None:
            joined.wait(30)
