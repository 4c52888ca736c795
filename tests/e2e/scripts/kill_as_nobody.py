"""`ddpkit kill --force --grace 1 PID` as the user nobody, for a machine where nobody cannot
reach the venv's python (CI's python lives under /root, mode 0700): started as root, it loads
what the command needs while the files are readable, then drops to nobody before it runs."""

import contextlib
import io
import os
import pwd
import sys

import ddpkit.cli
import ddpkit.cli.kill
import ddpkit.common.procs

with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    ddpkit.cli.main(["kill", "--help"])  # imports what building the parser needs
nobody = pwd.getpwnam("nobody")
os.setgroups([])
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
sys.exit(ddpkit.cli.main(["kill", "--force", "--grace", "1", sys.argv[1]]))
