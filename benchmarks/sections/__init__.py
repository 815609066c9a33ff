"""One module per benchmark case: its section of the report (`write(report)`)."""
