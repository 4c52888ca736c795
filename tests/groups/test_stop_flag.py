"""s.stop_requested on real gloo groups: a stop signal at a random moment, many times over, is
never lost, and every rank stops at the same step, at most two steps after it came."""

from __future__ import annotations

import random
import signal

import pytest

from tests.groups.harness import run_ranks

pytestmark = pytest.mark.timeout(180)

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _stopped_at_random_moments(rank, world, tmp, trials, reads_per_step):
    import os
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ddpkit.stopping import StopFlag

    dist.init_process_group("gloo")
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    outcomes = []
    for trial in range(trials):
        plan = random.Random(trial)  # the same plan on every rank
        target = plan.randrange(world)  # the rank the signal reaches (srun: any of them)
        sig = STOPS[trial % len(STOPS)]
        delay = plan.uniform(0.0, 0.03)
        flag = StopFlag()
        flag.agreed(world)  # the first read: from now on the signals only set the flag
        sent = {}

        now = {"step": 0}

        def send(sig=sig, delay=delay, sent=sent, now=now):
            time.sleep(delay)
            sent["step"] = now["step"]
            os.kill(os.getpid(), sig)

        steps, stopped_at = 0, None
        if rank == target:
            threading.Thread(target=send, daemon=True).start()
        while steps < 300:  # the signal comes within ~20 steps
            work = torch.ones(1)
            dist.all_reduce(work)  # the step's own collective keeps the ranks in step
            param.grad = torch.ones(4)
            opt.step()
            steps += 1
            now["step"] = steps
            time.sleep(random.uniform(0, 0.002))  # a step of uneven length
            answers = [flag.agreed(world) for _ in range(reads_per_step)]
            assert len(set(answers)) == 1, f"reads within one step disagree: {answers}"
            if answers[0]:
                stopped_at = steps
                break
        flag.close()
        dist.destroy_process_group(flag._group)
        outcomes.append((trial, stopped_at, sent.get("step"), signal.Signals(sig).name))
    dist.destroy_process_group()
    return outcomes


@pytest.mark.parametrize("reads_per_step", [1, 2])
def test_a_stop_signal_at_a_random_moment_stops_every_rank_at_the_same_step(
    tmp_path, reads_per_step
):
    trials = 30
    results = run_ranks(_stopped_at_random_moments, 3, tmp_path, trials, reads_per_step)
    for trial in range(trials):
        stops = [r[trial][1] for r in results]
        sent = next(r[trial][2] for r in results if r[trial][2] is not None)
        name = results[0][trial][3]
        assert None not in stops, f"trial {trial} ({name}): the signal was lost: {stops}"
        assert len(set(stops)) == 1, f"trial {trial} ({name}): ranks stopped apart: {stops}"
        # sent during step sent+1 at the latest; seen at the latest two step ends later
        assert sent < stops[0] <= sent + 3, f"trial {trial} ({name}): sent {sent}, {stops}"
