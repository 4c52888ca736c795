"""`python -m ddpkit`: the same as the `ddpkit` command."""

import sys

from ddpkit.cli import main

sys.exit(main())
