"""A Hugging Face Trainer script: a tiny GPT-2 built from a config (no download), a dataset of
token ids, TrainingArguments, a callback. Under `ddpkit run -n 2` (or torchrun) it trains on 2
CPU ranks.

    ddpkit run -n 2 hf_train.py OUTPUT_DIR [--stall-at STEP | --crash-at STEP]

--stall-at: rank 1 sleeps in the callback's on_step_end at that step; --crash-at: it raises.
"""

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=128, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Trouble(TrainerCallback):
    def __init__(self, stall_at, crash_at):
        self.stall_at, self.crash_at = stall_at, crash_at

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == self.stall_at:
            time.sleep(3600)  # the stall: rank 1 busy in the user's callback
        if args.process_index == 1 and state.global_step == self.crash_at:
            raise RuntimeError(f"callback failed at step {state.global_step} on purpose")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--stall-at", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    args = parser.parse_args()
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    config.bos_token_id = config.eos_token_id = 0
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        max_steps=12,
        learning_rate=1e-3,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        callbacks=[Trouble(args.stall_at, args.crash_at)],
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trained: {result.global_step} steps, loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
