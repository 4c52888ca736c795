"""A script written for `python -m torch.distributed.launch`: the local rank is an argument."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
print(f"local_rank={args.local_rank} epochs={args.epochs}")
