"""The ``marlaas`` command line: its commands, the demo and the job report."""
