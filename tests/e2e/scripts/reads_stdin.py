"""Rank 0 asks a question on stdin (as input() or pdb would)."""

import os

if os.environ["RANK"] == "0":
    answer = input("your name? ")
    print(f"hello {answer}")
else:
    print("rank 1 has no stdin")
