"""torch's own error recording (@record), as torchrun scripts use it."""

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise ValueError("recorded failure")


if __name__ == "__main__":
    main()
