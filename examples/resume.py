"""Stop and resume: the whole state saved now and then and when asked (SIGTERM, SIGUSR1, Ctrl+C
under ddpkit run), and the same script goes on where it was, to the step.

    ddpkit run -n 2 examples/resume.py             # stop it at any moment, run it again
    ddpkit run -n 2 --max-restarts 3 examples/resume.py
"""

import sys

import torch
from torch import nn

import ddpkit
from ddpkit.examples.digits import load_digits, split

train_set, _ = split(*load_digits())

with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    state = {"step": 0}
    train = s.loader(train_set, batch_size=32, to_device=True)
    if s.load_state("ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, state=state):
        s.print(f"resumed at step {state['step']}")
    s.print(f"training from step {state['step']}")
    while train.epoch < 10:
        for x, y in train:  # after a resume: the next batch, not a new epoch
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state["step"] += 1
            if state["step"] % 100 == 0 or s.stop_requested:
                s.save_state(
                    "ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, state=state
                )
            if s.stop_requested:  # every rank agrees, at the same step
                s.print(f"stopped at step {state['step']}, state saved")
                sys.exit(0)
    s.save_state("ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, state=state)
    s.print(f"done at step {state['step']}")
