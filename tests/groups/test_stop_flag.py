"""s.stop_requested on real gloo groups: a stop signal at a random moment, many times over, is
never lost, every rank stops at the same step, within two comparisons of the signal, and reads
within one step agree. (Two comparisons are counted, not timed: how long they take depends on
the step time, which on a loaded machine is anyone's guess; the gap's own bound, MAX_GAP s at
the measured step time, is the proposal's rule.)"""

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

    from ddpkit.train.stopping import StopFlag

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
        now = {"step": 0}
        seen = {}

        flags_handler = signal.getsignal(sig)

        def counted(signum, frame, handler=flags_handler, seen=seen, now=now):
            seen.setdefault("step", now["step"])  # the step the handler ran in
            handler(signum, frame)

        signal.signal(sig, counted)

        def send(sig=sig, delay=delay):
            time.sleep(delay)
            os.kill(os.getpid(), sig)

        steps, stopped_at, compared_at = 0, None, []
        if rank == target:
            threading.Thread(target=send, daemon=True).start()
        give_up = time.time() + 60
        while True:
            # the step's own collective keeps the ranks in step; it also carries the test's
            # giving up, so that a lost signal fails the trial on every rank instead of leaving
            # one rank waiting in a collective the others left
            late_here = torch.tensor([1 if time.time() > give_up else 0])
            dist.all_reduce(late_here, op=dist.ReduceOp.MAX)
            if late_here.item():
                break
            param.grad = torch.ones(4)
            opt.step()
            steps += 1
            now["step"] = steps
            time.sleep(random.uniform(0, 0.002))  # a step of uneven length
            due = flag._due
            answers = [flag.agreed(world) for _ in range(reads_per_step)]
            assert len(set(answers)) == 1, f"reads within one step disagree: {answers}"
            if flag._due != due or answers[0]:
                compared_at.append(steps)  # a comparison was read at this step
            if answers[0]:
                stopped_at = steps
                break
        flag.close()
        dist.destroy_process_group(flag._group)
        sent_step = seen.get("step")
        after = None if sent_step is None else [c for c in compared_at if c > sent_step]
        outcomes.append((trial, stopped_at, sent_step, signal.Signals(sig).name, after))
    dist.destroy_process_group()
    return outcomes


@pytest.mark.parametrize(("reads_per_step", "trials"), [(1, 10), (2, 6)])
def test_a_stop_signal_at_a_random_moment_stops_every_rank_at_the_same_step(
    tmp_path, reads_per_step, trials
):
    results = run_ranks(
        _stopped_at_random_moments, 3, tmp_path, trials, reads_per_step, timeout=150
    )
    for trial in range(trials):
        stops = [r[trial][1] for r in results]
        sent = next(r[trial][2] for r in results if r[trial][2] is not None)
        name = results[0][trial][3]
        compared = next(r[trial][4] for r in results if r[trial][4] is not None)
        assert None not in stops, f"trial {trial} ({name}): the signal was lost: {stops}"
        assert len(set(stops)) == 1, f"trial {trial} ({name}): ranks stopped apart: {stops}"
        assert stops[0] > sent, f"trial {trial} ({name}): stopped before the signal"
        assert len(compared) <= 2, (
            f"trial {trial} ({name}): signal at step {sent}, comparisons read at {compared}"
        )
