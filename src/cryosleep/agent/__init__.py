"""The node agent: launches workers in a capturable sandbox, supervises them, executes snapshots."""
