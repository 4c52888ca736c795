"""The speed doctor in the launcher: step records, straggler verdicts, evidence."""
