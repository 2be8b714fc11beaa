"""The command line: one module per command group; each parses, calls, and prints a table or JSON."""
