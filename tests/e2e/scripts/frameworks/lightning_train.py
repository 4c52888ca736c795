"""A PyTorch Lightning script as its docs write one: a LightningModule, a Trainer with the DDP
strategy, `trainer.fit`. Under `ddpkit run -n 2` (or torchrun) it trains on 2 CPU ranks.

    ddpkit run -n 2 lightning_train.py [--stall-at STEP | --crash-at STEP]

--stall-at: rank 1 sleeps in training_step at that batch; --crash-at: rank 1 raises there.
"""

import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, stall_at=-1, crash_at=-1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.stall_at, self.crash_at = stall_at, crash_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and batch_idx == self.stall_at:
            time.sleep(3600)  # the stall: rank 1 never reaches its backward
        if self.global_rank == 1 and batch_idx == self.crash_at:
            raise ValueError(f"bad batch {batch_idx} on purpose")
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stall-at", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    args = parser.parse_args()
    L.seed_everything(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(args.stall_at, args.crash_at)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        print(f"trained: loss {trainer.callback_metrics['train_loss'].item():.4f}", flush=True)


if __name__ == "__main__":
    main()
