"""The one place the version lives (read by pyproject and `ddpkit --version`)."""

__version__ = "0.1.0"
