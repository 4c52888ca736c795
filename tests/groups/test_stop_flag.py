"""s.stop_requested on real gloo groups: a stop signal at a random moment, many times over, is
never lost, every rank stops at the same step, within two comparisons of the signal (at most
2 x stopping.MAX_GAP s), and reads within one step agree."""

from __future__ import annotations

import random
import signal

import pytest

from ddpkit.train.stopping import MAX_GAP
from tests.groups.harness import run_ranks

pytestmark = pytest.mark.timeout(180)

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _stopped_at_random_moments(rank, world, tmp, trials, reads_per_step):
    import os
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ddpkit.train.stopping import MAX_GAP, StopFlag  # noqa: F811 - in the rank's process

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
            sent["step"], sent["at"] = now["step"], time.time()
            os.kill(os.getpid(), sig)

        steps, stopped_at, stopped_when = 0, None, None
        if rank == target:
            threading.Thread(target=send, daemon=True).start()
        give_up = time.time() + 2 * MAX_GAP + 5
        while time.time() < give_up:
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
                stopped_at, stopped_when = steps, time.time()
                break
        flag.close()
        dist.destroy_process_group(flag._group)
        late = stopped_when - sent["at"] if stopped_when and sent else None
        outcomes.append((trial, stopped_at, sent.get("step"), signal.Signals(sig).name, late))
    dist.destroy_process_group()
    return outcomes


@pytest.mark.parametrize(("reads_per_step", "trials"), [(1, 10), (2, 6)])
def test_a_stop_signal_at_a_random_moment_stops_every_rank_at_the_same_step(
    tmp_path, reads_per_step, trials
):
    results = run_ranks(_stopped_at_random_moments, 3, tmp_path, trials, reads_per_step)
    for trial in range(trials):
        stops = [r[trial][1] for r in results]
        sent = next(r[trial][2] for r in results if r[trial][2] is not None)
        name = results[0][trial][3]
        late = next(r[trial][4] for r in results if r[trial][4] is not None)
        assert None not in stops, f"trial {trial} ({name}): the signal was lost: {stops}"
        assert len(set(stops)) == 1, f"trial {trial} ({name}): ranks stopped apart: {stops}"
        assert stops[0] > sent, f"trial {trial} ({name}): stopped before the signal"
        assert late < 2 * MAX_GAP + 1, f"trial {trial} ({name}): seen {late:.2f} s late"
